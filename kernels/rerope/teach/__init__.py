"""The book's stage kernels: one module per chapter, short enough to read on one screen.

Each is checked against the float64 reference and against the finished kernels (tests/).
"""

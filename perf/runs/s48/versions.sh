# Sourced by session 48's device scripts: the GPU and the versions into $OUT/versions.txt.
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
} > "$OUT/versions.txt" 2>&1

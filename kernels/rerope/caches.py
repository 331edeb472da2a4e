"""The package's caches: one bound, one helper.

Every cache in ``rerope`` is an :class:`LRUCache` of at most :data:`CACHE_SIZE` entries (or a
``functools.lru_cache(maxsize=CACHE_SIZE)``), keyed by *values* only: shapes, strides, dtypes,
devices, settings, frequencies as :class:`rerope.rope.Frequencies` — never by an object's
identity nor by its in-place version counter (a change through ``.data`` does not bump it), so
no cache can answer for an input that changed since. What these caches hold: the cos/sin
tables and offset vectors (:mod:`rerope.rotary`), the fused form's operands and the plans and
bound launches of every op (:mod:`rerope.attention`, :mod:`rerope.decode`).
"""

from collections import OrderedDict

# The most entries any one cache keeps. A table is ``capacity × D`` fp32 (0.5 MiB at D=32 and
# up to 4096 positions, 2 MiB at D=128), so the tables of a device stay below ~130 MiB at
# D=128 for sequences up to 4k; a model uses a handful of tables and plans per setting.
CACHE_SIZE = 64

_NOTHING = object()     # equal to no key


class LRUCache:
    """A ``dict`` of at most :data:`CACHE_SIZE` entries that drops the least recently used one
    when full (a growing KV cache makes a new plan key per step: the old ones age out).

    ``get(key)`` returns ``None`` for a missing key; ``put(key, value)`` (or ``cache[key] =
    value``) stores and returns ``value``. An unhashable key raises ``TypeError``, as a ``dict``
    would. Safe to share between threads (a lost race costs a rebuild, never a wrong entry).
    """

    def __init__(self, size=CACHE_SIZE):
        self.size = size
        self._entries = OrderedDict()
        # (key, value) of the last get or put: the most recently used entry already, so a
        # repeat of its key (a decode step's layers, a training loop) is one comparison, not
        # two hashes of a long key (the lookup and the reordering)
        self._last = (_NOTHING, None)

    def get(self, key):
        last_key, value = self._last
        try:
            if last_key == key:
                return value
        except Exception:          # an element whose == is no truth value (a tensor): the
            pass                   # dict decides, by hash, as for any other key
        entries = self._entries
        try:
            value = entries[key]
            entries.move_to_end(key)
        except KeyError:           # missing, or dropped by another thread meanwhile
            return None
        self._last = (key, value)
        return value

    def put(self, key, value):
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.size:
            try:
                entries.popitem(last=False)
            except KeyError:       # emptied by another thread meanwhile
                break
        self._last = (key, value) if self.size > 0 else (_NOTHING, None)
        return value

    __setitem__ = put

    def values(self):
        """The entries, least recently used first (a list: safe while the cache changes)."""
        return list(self._entries.values())

    def clear(self):
        self._last = (_NOTHING, None)
        self._entries.clear()

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

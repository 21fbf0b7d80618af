"""GraniKV storage layer: HOT slab pool, COLD token pool, one prefix index, HOT-first admission."""
from granikv.kv.admission import Admission, Placement
from granikv.kv.cold_pool import ColdPool
from granikv.kv.hot_pool import HotPool, Slab
from granikv.kv.kv_cache import KVCache
from granikv.kv.prefix_index import Node, PrefixIndex, PrefixMatch

__all__ = ["Admission", "Placement", "ColdPool", "HotPool", "Slab", "KVCache", "Node",
           "PrefixIndex", "PrefixMatch"]

"""GraniKV storage layer: HOT slab pool, COLD token pool, one prefix index, HOT-first admission,
and the optional dynamic HOT/COLD split."""
from granikv.kv.admission import Admission, Placement
from granikv.kv.cold_pool import ColdPool
from granikv.kv.dynamic_split import DynamicSplit
from granikv.kv.hot_pool import HotPool, Slab
from granikv.kv.kv_cache import KVCache
from granikv.kv.prefix_index import Node, PrefixIndex, PrefixMatch
from granikv.kv.split_policy import SplitPolicy

__all__ = ["Admission", "Placement", "ColdPool", "DynamicSplit", "HotPool", "Slab", "KVCache", "Node",
           "PrefixIndex", "PrefixMatch", "SplitPolicy"]

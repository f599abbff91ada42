"""The plain Python face of cpkv; Ray stays inside.

client = cpkv.connect(cp_size=4, page_size=64, num_pages_per_lane=4096)
alloc = client.allocate_extend("req-1", token_ids)
client.store_kv(alloc.out_cache_loc, k, v)        # the lanes' K/V for those tokens
client.free("req-1")
client.shutdown()
"""

from cpkv.client._client import CPKVClient
from cpkv.client._connect import DEFAULT_NAME as DEFAULT_NAME  # the default pool name
from cpkv.client._connect import connect
from cpkv.results import PrefillResult

__all__ = ["CPKVClient", "PrefillResult", "connect"]

"""pyrl.protocol: DataProto (verl's API) over packed token-level data, and the C++ index work of batching.

    from pyrl.protocol import DataProto, balanced_partitions, token_budget_micro_batches
"""

from pyrl.protocol.balance import balanced_partitions, token_budget_micro_batches
from pyrl.protocol.dataproto import (
                                     DataProto,
                                     DataProtoItem,
                                     pad_dataproto_to_divisor,
                                     response_lengths,
                                     unpad_dataproto,
)
from pyrl.protocol.packed import PackedLayout, PackedTensor, left_padded

__all__ = [
    "response_lengths",
    "DataProto",
    "DataProtoItem",
    "PackedLayout",
    "PackedTensor",
    "balanced_partitions",
    "left_padded",
    "pad_dataproto_to_divisor",
    "token_budget_micro_batches",
    "unpad_dataproto",
]

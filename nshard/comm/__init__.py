"""Gradient reducers (dense, PowerSGD), their transports (torch.distributed, mpi4py) and byte ledger.

Imports only torch, numpy and (lazily) mpi4py: DeepSpeed stays in nshard/seam/.
"""

from nshard.comm.agree import RanksDisagree
from nshard.comm.config import ConfigError, ReducerConfig, validate_config
from nshard.comm.dense import DenseReducer
from nshard.comm.ledger import ByteLedger
from nshard.comm.powersgd import PowerSGDReducer, PowerSGDState
from nshard.comm.reducer import Reducer, build_reducer
from nshard.comm.transport import MpiTransport, TorchTransport, Transport, build_transport

__all__ = [
    "ByteLedger",
    "ConfigError",
    "DenseReducer",
    "MpiTransport",
    "PowerSGDReducer",
    "PowerSGDState",
    "RanksDisagree",
    "Reducer",
    "ReducerConfig",
    "TorchTransport",
    "Transport",
    "build_reducer",
    "build_transport",
    "validate_config",
]

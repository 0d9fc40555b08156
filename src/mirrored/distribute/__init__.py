"""The distribution core: strategies, replica contexts, distributed values and variables,
cross-device ops and distributed input. Knows nothing of `mirrored.training`."""
from mirrored.distribute._run_path import RunOptions
from mirrored.distribute.cluster_resolver import ClusterResolver
from mirrored.distribute.context import (ReplicaContext, get_replica_context, get_strategy, has_strategy,
                                         in_cross_replica_context, register_scope_hook)
from mirrored.distribute.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, InMemoryAllReduce,
                                                  NcclAllReduce, ReductionToOneDevice)
from mirrored.distribute.input import (DistributedDataset, DistributedDatasetsFromFunction, DistributedIterator,
                                      InputContext, InputOptions, Optional, split_global_batch)
from mirrored.distribute.modules import (HookHandles, MirroredModule, mirror_holding, register_adapter_loader,
                                         register_copier, register_state_tensors, register_synced_tensors)
from mirrored.distribute.optimizer import MirroredOptimizer
from mirrored.distribute.reducer import GradientReducer
from mirrored.distribute.random import ReplicaRandom, StepRandom, StrategyRandom, WithoutReplicaRandom
from mirrored.distribute._collectives import CollectiveAllReduce
from mirrored.distribute.multi_worker import CommunicationOptions, MultiWorkerMirroredStrategy
from mirrored.distribute.rollback import StepJournal, current_journal
from mirrored.distribute.replicas import CollectiveMismatchError, CollectiveTimeoutError
from mirrored.distribute.strategy import (MirroredStrategy, OneDeviceStrategy, OutOfSyncError, Strategy,
                                          ValueContext)
from mirrored.distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp, flatten, map_structure
from mirrored.distribute.variables import (MirroredVariable, SyncOnReadVariable, Variable, VariableAggregation,
                                           VariableSynchronization)

__all__ = [
    "ClusterResolver", "CollectiveAllReduce", "CollectiveMismatchError", "CollectiveTimeoutError", "CommunicationOptions",
    "CrossDeviceOps", "DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator",
    "DistributedValues", "GradientReducer", "HierarchicalCopyAllReduce", "HookHandles", "InMemoryAllReduce", "InputContext",
    "InputOptions", "Mirrored", "MirroredModule", "MirroredOptimizer", "MirroredStrategy", "MirroredVariable",
    "MultiWorkerMirroredStrategy", "NcclAllReduce", "OneDeviceStrategy", "Optional", "OutOfSyncError", "PerReplica", "ReduceOp",
    "ReductionToOneDevice", "ReplicaContext", "ReplicaRandom", "RunOptions", "StepJournal", "StepRandom", "Strategy", "StrategyRandom", "SyncOnReadVariable", "ValueContext", "Variable",
    "VariableAggregation", "VariableSynchronization", "WithoutReplicaRandom", "current_journal", "flatten", "get_replica_context",
    "get_strategy", "has_strategy", "in_cross_replica_context", "map_structure", "mirror_holding", "register_adapter_loader", "register_copier",
    "register_scope_hook", "register_state_tensors", "register_synced_tensors", "split_global_batch",
]

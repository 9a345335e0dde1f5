"""ringtrain for Keras 3 users: the article's six steps on Keras' PyTorch backend.

::

    import ringtrain as rt
    import ringtrain.keras as rtk          # sets KERAS_BACKEND=torch if Keras is not loaded yet
    from ringtrain.data import Loader
    import keras

    rt.init()                                                   # (1)
    # (2) one device per process: rt.init() pins cuda:<local_rank> when there are GPUs
    opt = rtk.DistributedOptimizer(keras.optimizers.Adadelta(rt.scale_lr(1.0)))  # (3), (6)
    model.compile(optimizer=opt, loss=..., metrics=["accuracy"])
    callbacks = [rtk.BroadcastGlobalVariablesCallback(0),       # (4)
                 rtk.MetricAverageCallback(),
                 rtk.CheckpointCallback("ckpt")]                # (5) writes on rank 0 only
    model.fit(rtk.LoaderDataset(Loader(train, batch_size=64)),
              epochs=math.ceil(12 / rt.size()), callbacks=callbacks,
              verbose=1 if rt.rank() == 0 else 0)

``horovod.keras``'s module calls are here too (``init``, ``size``, ``rank``, ``local_rank``,
``local_size``, ``allreduce``, ``allgather``, ``broadcast``, ``Compression``, ``load_model``,
``hvd.callbacks.*`` with ``LearningRateScheduleCallback`` and ``BestModelCheckpoint``,
``PartialDistributedOptimizer``), so ``import ringtrain.keras as
hvd`` runs a Horovod Keras script.

Needs ``pip install 'ringtrain[keras]'``; importing this package without Keras raises
ImportError, and with Keras on another backend a ConfigError. See docs/keras.md.
"""

from __future__ import annotations

from ringtrain.keras._backend import load_keras

load_keras()  # before the submodules: they subclass Keras classes at import

from ringtrain.keras.basics import (  # noqa: E402
    Average,
    Compression,
    Sum,
    allgather,
    allreduce,
    broadcast,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    load_model,
    local_rank,
    local_size,
    rank,
    reducescatter,
    shutdown,
    size,
)
from ringtrain.keras.callbacks import (  # noqa: E402
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    broadcast_variables,
    model_state_variables,
)
from ringtrain.keras.checkpoint import CheckpointCallback, keras_state, restore  # noqa: E402
from ringtrain.keras.data import LoaderDataset  # noqa: E402
from ringtrain.keras.optimizer import DistributedOptimizer, GradientExchange, PartialDistributedOptimizer  # noqa: E402

__all__ = [
    "Average",
    "Compression",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
    "DistributedOptimizer",
    "GradientExchange",
    "PartialDistributedOptimizer",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateWarmupCallback",
    "LearningRateScheduleCallback",
    "CheckpointCallback",
    "LoaderDataset",
    "restore",
    "keras_state",
    "broadcast_variables",
    "model_state_variables",
    "load_keras",
]

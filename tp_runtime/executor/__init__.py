"""Executors: how the driver reaches its workers.

- InProcessExecutor: TP=1 in the driver's own process (no sockets, no process group).
- MultiprocExecutor: one process per rank, each a fresh interpreter (`python -m tp_runtime.worker.process`:
  the user's main module is never re-imported, so scripts need no __main__ guard). The driver broadcasts
  over a ZeroMQ XPUB socket and reads replies from a PULL socket; only rank 0 answers a step. Start-up
  waits until every worker has subscribed (XPUB reports each subscription, so no message is lost to the
  PUB/SUB slow joiner) and sent READY. While waiting for any reply the driver polls the worker
  processes, so a dead worker is an error naming its rank within a fraction of a second, and every wait
  has a timeout. Workers hold their stdin pipe from the driver and exit when it closes, so they never
  outlive the driver.
- TorchrunExecutor: torchrun started every rank; rank 0 runs the driver plus its own worker in-process,
  ranks > 0 run the worker loop and connect to rank 0 over TCP.

Transport security (see serialize.py for the frame format, its HMAC, and CURVE on TCP):
- Every frame is authenticated with a per-engine key and numbered per sender; anything else is dropped and
  logged. An authentic reply that makes no sense (a step not in flight, a duplicate, lists of different
  lengths) is a ProtocolError naming the problem.
- Every receiving socket has zmq.MAXMSGSIZE set to the largest legitimate message of the config (a peer
  that sends more is disconnected), and what peers send into the broadcast socket is read and discarded.
- Spawned mode listens on nothing but ipc sockets (0600, in a 0700 folder) and, for the process group, a
  FileStore in that folder with gloo/NCCL on the loopback interface. Under torchrun the driver binds
  127.0.0.1 when every rank is on one host; across hosts it binds MASTER_ADDR and requires a shared
  secret (TP_RUNTIME_SECRET or TP_RUNTIME_SECRET_FILE), from which each job derives its own key.
- Liveness: every worker sends a heartbeat each HEARTBEAT_INTERVAL_S from its own thread, read by a
  watchdog thread in the driver. A rank silent for HEARTBEAT_TIMEOUT_S is a StepTimeoutError naming it
  (spawned mode: unless its process is running, as it is while holding the GIL through a long compile;
  the step timeout bounds that); a step timeout names the silent or stopped rank, or says that none is
  known. Under torchrun, where rank 0 has no process handles, a killed rank is named by its closed
  connection and its silence, and when rank 0's own worker stays blocked in a collective with a dead or
  silent rank, the watchdog ends the job.
"""

from tp_runtime.executor.base import Executor, make_executor

__all__ = ["Executor", "make_executor"]

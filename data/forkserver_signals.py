"""Imported in the decode workers' forkserver only (its preload list, data/decode_workers.py):
SIGTERM is ignored there, and so in every worker it forks.

Importing it anywhere else would make that process ignore SIGTERM: nothing else does.

Why: SLURM's preemption, ``scancel``, torchrun's stop and a container's stop signal a
whole process group. The forkserver died of it (SIGINT it already ignores), and a
worker's exit status reaches the trainer through the forkserver, so every worker then
read as dead (exit code 255): the trainer's graceful stop (a checkpoint, exit 75)
became a "decode worker died" error, and the trainer's close did not wait for the
workers before unlinking their shared memory. The trainer alone acts on the signal; it
stops its workers itself, and they and the forkserver exit when it is gone.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

"""`elastic-run` (also `python -m elastic.launch`): start and keep this host's workers of a job.

One concept a module:

* ``config``    the flags and the environment, read once into ``LaunchConfig``
* ``launcher``  the main loop: spawn, reap, respawn, follow the job through Status, end
* ``procs``     local worker processes: process groups, output prefixes, exit statuses, stopping
* ``embedded``  the embedded rendezvous server (without --rendezvous)
* ``discovery`` --host-discovery-script: run it, parse its ``host[:slots]`` lines
* ``report``    what the launcher says as the job runs: a pure function of Status answers
* ``outcome``   its exit status after the job completed: a pure function of how its workers ended

The job's state comes from the public Status client (``rendezvous.client.status_client.StatusClient``).
"""

from elastic.launch.launcher import main

__all__ = ["main"]

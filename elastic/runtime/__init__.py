"""The worker's runtime: its session with the job, and the current world every layer asks about.

``session`` owns the step protocol (form, sync, commit, membership check, recovery) and is the
one process-wide object (``current``); ``world`` answers ``rank()``, ``size()`` … from it;
``reaction`` and ``step_phase`` are the pure rules it follows; ``hooks`` is what a layer above
plugs into it. Imports the ring (``elastic.ring``) and the rendezvous client and wire
(``rendezvous.client``, ``rendezvous.wire``, ``rendezvous.common``); never the layers above
(state, torch, sharded): they are handed to it as values.
"""

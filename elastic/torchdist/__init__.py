"""torch.distributed on the elastic ring: the process group, DDP, the optimizer, device meshes.

``group`` is the one ``ProcessGroup`` that follows re-forms; ``ddp`` is torch DDP on it;
``objects`` carries torch's object collectives in the ring's format; ``mesh`` makes a
``DeviceMesh`` per world; ``guidance`` turns torch's errors into ones naming our fix. Every write
into torch's private c10d tables is in ``c10d_tables``. Imports the ring, the runtime and the
state; the sharded state above imports it.
"""

// Ring sockets a forked child lets go of: a process forked from a worker (a DataLoader's
// workers, any multiprocessing fork) inherits every descriptor, and a child holding the
// worker's ring connections keeps them open after the worker is killed, so its neighbours
// would learn of the death only when the child exits or a timeout fires.
#pragma once

namespace ering {

// Registers a socket of the ring (listening or connected) that this process owns. In a child
// forked after this (pthread_atfork), it is replaced by /dev/null: the connection is the
// parent's alone, and the number stays taken, so nothing in the child that still holds it can
// close or write to a descriptor the child opens later. Sockets closed since they were
// registered are recognized by device and inode and left alone.
void guard_from_fork(int fd);

}  // namespace ering

"""The generated messages (`pb`) and stubs (`pb_grpc`) of protos/rendezvous.proto, for tools that
speak the wire directly: load generators, fuzzers, tests of the wire. Workers and tools use
rendezvous.client instead."""

from ._proto import rendezvous_pb2 as pb
from ._proto import rendezvous_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]

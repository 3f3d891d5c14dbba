"""The wire between workers and the rendezvous service: the generated gRPC messages and stubs of
``protos/rendezvous.proto`` (``messages``) and the job and world types both sides speak
(``membership``). Imports only ``rendezvous.common``.
"""

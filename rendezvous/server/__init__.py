"""The rendezvous service: the pure membership decision (``decision``) and its helpers, the gRPC
service that feeds it (``service``), leader election, the store (etcd v3 or memory), metrics.
Imports the wire and the common layer; never the clients. Only ``rendezvous.cli`` starts it.
"""

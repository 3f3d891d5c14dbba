"""elastic-ring's rendezvous service: membership decision, stores, gRPC server, worker client, CLI."""

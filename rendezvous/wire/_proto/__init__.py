"""Generated gRPC stubs for protos/rendezvous.proto (do not edit; regenerate with `python -m rendezvous.wire.codegen`)."""

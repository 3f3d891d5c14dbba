"""The committed gRPC stubs must be exactly what grpcio-tools generates from protos/rendezvous.proto."""
from rendezvous.wire import codegen as _codegen


def test_committed_stubs_match_proto(tmp_path):
    generated = _codegen.generate(tmp_path)
    drifted = [p.name for p in generated
               if p.read_bytes() != (_codegen.STUB_DIR / p.name).read_bytes()]
    assert not drifted, (f"stubs {drifted} in rendezvous/wire/_proto/ drifted from protos/rendezvous.proto;"
                         f" run `python -m rendezvous.wire.codegen` and commit the result")


def test_stubs_import_as_package():
    from rendezvous.wire._proto import rendezvous_pb2, rendezvous_pb2_grpc

    assert rendezvous_pb2.DESCRIPTOR.package == "elastic.rendezvous.v1"
    assert hasattr(rendezvous_pb2_grpc, "RendezvousStub")

"""Regenerate the Python code for serving/proto/*.proto (needs grpcio-tools, a dev dependency).

    python -m serving.proto.regen          # rewrite inference_pb2.py, inference_pb2.pyi, inference_pb2_grpc.py
    python -m serving.proto.regen --check  # exit 1 if inference_pb2 no longer matches inference.proto
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ["serving/proto/inference.proto"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(ROOT / p) for p in PROTOS]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def descriptor_in_sync() -> bool:
    """The committed inference_pb2 embeds the descriptor that protoc builds from inference.proto today
    (compared as FileDescriptorProtos, so a different protoc version does not matter)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from serving.proto import inference_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        if protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", str(ROOT / PROTOS[0])]) != 0:
            raise SystemExit("protoc failed")
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    msgs = list(fresh.message_type)
    while msgs:  # the Python generator drops json_name from the embedded descriptor
        m = msgs.pop()
        msgs += list(m.nested_type)
        for f in m.field:
            f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(inference_pb2.DESCRIPTOR.serialized_pb)
    return fresh == committed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    a = ap.parse_args(argv)
    if not a.check:
        generate(ROOT)
        return 0
    if not descriptor_in_sync():
        print("stale generated code: run python -m serving.proto.regen")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The descriptors the public port's server reflection may describe: the public API, the gateways'
vllm.grpc.engine, health and reflection, and what they import; nothing else.

grpc_reflection answers from protobuf's default descriptor pool unless given one, and this
process also loads the worker protocol (nanovllm.worker.v1, for its own Step calls): from the
default pool, `grpcurl describe nanovllm.worker.v1.Worker` on the public port would describe the
internal API.
"""
from __future__ import annotations

from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

from common.generated.nanovllm.generate.v1 import generate_pb2

PUBLIC_FILES = (generate_pb2.DESCRIPTOR, vllm_engine_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)


def _add_with_dependencies(pool: descriptor_pool.DescriptorPool, file: descriptor.FileDescriptor,
                           added: set[str]) -> None:
    if file.name in added:
        return
    for dependency in file.dependencies:  # a file can only be added after its imports
        _add_with_dependencies(pool, dependency, added)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    pool.Add(proto)
    added.add(file.name)


def public_descriptor_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()
    for file in PUBLIC_FILES:
        _add_with_dependencies(pool, file, added)
    return pool

"""Wire contracts of the swarm: schemas, generated code and the pure frame codec.

- ``swarm/v1/*.proto``: the ``swarm.v1`` schemas (``Frame`` and its bodies,
  ``Status``/``Error``, the ``ShardService`` gRPC service); the generated
  ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to them come from
  ``python -m proto.generate``.
- ``codec``: build, validate, parse, chunk and reassemble activation frames
  (``SCHEMA_VERSION`` lives here).
- ``tensor_codec``: tensor encodings (f32, f16, int8 blocks) and checksums.
- ``errors``: the exception tree, one class per wire status.
- ``vocab``: chunks of the metadata-only GGUF served by ``GetVocab``.
- ``recipe``: the runtime-recipe fingerprint.
- ``signing``, ``announce``: signed envelopes, route tickets and announcements.

The specification is ``docs/protocol.md``. Everything here except the
generated ``_pb2_grpc`` module is pure: no I/O, no event loop, no grpc.
"""

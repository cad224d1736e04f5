"""Generated gRPC stubs for sluice.v1 (gateway/proto/sluice/v1/gateway.proto).

Do not edit: regenerate with `python clients/python/tools/generate.py`; tests/test_generated.py
fails when they drift from the proto."""

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PASS: _ClassVar[Action]
    MODIFY: _ClassVar[Action]
    BLOCK: _ClassVar[Action]
    SKIP: _ClassVar[Action]
    DETECT: _ClassVar[Action]
PASS: Action
MODIFY: Action
BLOCK: Action
SKIP: Action
DETECT: Action

class RunRequest(_message.Message):
    __slots__ = ("namespace", "target", "trigger_point", "text", "value", "context", "session_id")
    class ContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_POINT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    target: str
    trigger_point: str
    text: str
    value: _struct_pb2.Value
    context: _containers.ScalarMap[str, str]
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., target: _Optional[str] = ..., trigger_point: _Optional[str] = ..., text: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., context: _Optional[_Mapping[str, str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class HookOutcome(_message.Message):
    __slots__ = ("name", "action", "message", "findings", "error", "latency_us", "output")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    action: Action
    message: str
    findings: _struct_pb2.Value
    error: str
    latency_us: int
    output: str
    def __init__(self, name: _Optional[str] = ..., action: _Optional[_Union[Action, str]] = ..., message: _Optional[str] = ..., findings: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[str] = ..., latency_us: _Optional[int] = ..., output: _Optional[str] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("action", "text", "value", "message", "hooks", "terminal_index", "run_id")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    action: Action
    text: str
    value: _struct_pb2.Value
    message: str
    hooks: _containers.RepeatedCompositeFieldContainer[HookOutcome]
    terminal_index: int
    run_id: str
    def __init__(self, action: _Optional[_Union[Action, str]] = ..., text: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., message: _Optional[str] = ..., hooks: _Optional[_Iterable[_Union[HookOutcome, _Mapping]]] = ..., terminal_index: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("namespace", "target", "trigger_point", "context", "session_id", "chunk_by_chunk")
    class ContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_POINT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BY_CHUNK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    target: str
    trigger_point: str
    context: _containers.ScalarMap[str, str]
    session_id: str
    chunk_by_chunk: bool
    def __init__(self, namespace: _Optional[str] = ..., target: _Optional[str] = ..., trigger_point: _Optional[str] = ..., context: _Optional[_Mapping[str, str]] = ..., session_id: _Optional[str] = ..., chunk_by_chunk: _Optional[bool] = ...) -> None: ...

class StreamFinish(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("open", "chunk", "finish")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    chunk: str
    finish: StreamFinish
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., chunk: _Optional[str] = ..., finish: _Optional[_Union[StreamFinish, _Mapping]] = ...) -> None: ...

class StreamBlocked(_message.Message):
    __slots__ = ("message", "hook")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HOOK_FIELD_NUMBER: _ClassVar[int]
    message: str
    hook: str
    def __init__(self, message: _Optional[str] = ..., hook: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("commit", "blocked", "final")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    commit: str
    blocked: StreamBlocked
    final: RunResponse
    def __init__(self, commit: _Optional[str] = ..., blocked: _Optional[_Union[StreamBlocked, _Mapping]] = ..., final: _Optional[_Union[RunResponse, _Mapping]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("name", "payload", "caller")
    class CallerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    name: str
    payload: _struct_pb2.Value
    caller: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., caller: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("result", "consumed")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    result: _struct_pb2.Value
    consumed: _struct_pb2.Value
    def __init__(self, result: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., consumed: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...

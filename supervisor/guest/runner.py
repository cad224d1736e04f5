"""The Python side of a cell: what runs inside every WebAssembly instance the supervisor makes.

componentize-py turns this module into a pre-initialised component at build time: the interpreter is
started, this module and the standard-library modules hooks commonly use are imported and warmed up,
and the memory that results is the snapshot every instance starts from. Nothing of any hook or
payload is in it. Each hook of each trigger point then runs in a fresh instance of that snapshot,
which the supervisor drops afterwards: whatever a hook changes here (globals, modules, builtins,
its in-memory `/tmp`, see tmpfs.py) is gone with its instance.

Everything in this file can be tampered with by the hook that runs beside it, in its own instance:
the supervisor re-checks what comes out, and so does the gateway.
"""

import builtins
import io
import json
import marshal
import random
import sys
import traceback

import tmpfs
import wit_world
from componentize_py_types import Err

TRACEBACK_CHARS = 2000

# The standard library a hook may import: imported into the snapshot, so an instance pays nothing
# for them and nothing is read from a filesystem at run time (an instance has none). Modules that
# need what WebAssembly has not (threads, processes, sockets, signals) are not here; importing one
# fails with a message that says so. `sluice check` and docs/hooks.md use this same list.
STDLIB = (
    "abc", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "codecs", "collections",
    "collections.abc", "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "enum", "errno", "fnmatch", "fractions", "functools", "gzip", "hashlib", "heapq", "hmac",
    "html", "html.parser", "io", "ipaddress", "itertools", "json", "keyword", "math", "numbers",
    "operator", "pprint", "random", "re", "secrets", "shlex", "statistics", "string", "struct",
    "textwrap", "time", "typing", "unicodedata", "urllib.parse", "uuid", "warnings", "weakref",
    "xml.etree.ElementTree", "zlib",
)

class SandboxFinder:
    """Answers an import of anything not in the snapshot with why: an instance has no filesystem to
    find it in, and the sandbox offers no network, processes or threads to use it with."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        top = name.partition(".")[0]
        raise ModuleNotFoundError(
            f"No module named {name!r} in the sandbox: hooks may import the standard library's "
            f"text, data and math modules (see docs/hooks.md); {top!r} is not among them",
            name=name,
        )


def stop_at_line_after(filename, seconds, covered):
    """Authoring tools' mode (`sluice test`, `sluice run`): trace the hook's lines, noting each one
    run in `covered` (`sluice test --coverage`), and once `seconds` have passed raise where it is,
    so the error names the line an endless loop or slow code is on (the supervisor's hard deadline,
    a little later, names none). Never in a gateway that serves: tracing every line is slow."""
    import time

    end = time.monotonic() + seconds

    def line(frame, event, arg):
        if event == "line":
            covered.add(frame.f_lineno)
            if time.monotonic() > end:
                sys.settrace(None)
                raise TimeoutError(
                    f"ran out of time at line {frame.f_lineno}: an endless loop or slow code there "
                    "(the chain's spec.timeoutMs is the time all its hooks share)"
                )
        return line

    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename == filename else None)


CO_OPTIMIZED = 0x1


def code_lines(code, at_import):
    """The lines of a hook's compiled module that can run: `at_import` those its module code runs
    when the hook is loaded (the module's own statements and class bodies), else those of its
    functions."""
    lines = set()
    pending = [(code, True)]
    while pending:
        c, imported = pending.pop()
        if imported == at_import:
            lines.update(line for _, _, line in c.co_lines() if line is not None and line > 0)
        for const in c.co_consts:
            if isinstance(const, type(code)):
                pending.append((const, imported and not const.co_flags & CO_OPTIMIZED))
    return lines


def coverage(compiled, covered):
    """Which lines of the hook ran (its module code ran whole when it was loaded, or the call
    failed) and which could have: what `--trace-lines` adds to an answer."""
    run = covered | code_lines(compiled, True)
    return {"run": sorted(run), "code": sorted(run | code_lines(compiled, False))}


class HostCallError(Exception):
    """Raised inside a hook when a host_call is denied or fails; `code` says which way (`denied`,
    `invalid`, `unavailable`, `timeout`, `limit`, `forbidden`, `error`) and the message why."""

    def __init__(self, message, code="error"):
        super().__init__(message)
        self.code = code


class Context(dict):
    """What a hook's execute receives: a dict that also allows attribute access and host_call."""

    __slots__ = ()

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def host_call(name, payload=None):
    """`context.host_call(name, payload)`: the supervisor relays it to the gateway and blocks this
    instance until the answer comes back."""
    if not isinstance(name, str) or not name:
        raise HostCallError("host_call needs a capability name", "invalid")
    try:
        text = json.dumps(payload, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise HostCallError(f"host_call payload is not JSON-serializable: {e}", "invalid") from None
    try:
        return json.loads(wit_world.host_call(name, text))
    except Err as e:
        try:
            error = json.loads(e.value)
        except ValueError:
            error = {"message": str(e.value)}
        raise HostCallError(str(error.get("message") or "host_call failed"), str(error.get("code") or "error")) from None


def filename_of(name):
    return f"<hook {name}>"


def trimmed_traceback(exc, filename):
    """The hook's own frames of a traceback, short enough for an audit line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = [f'  line {f.lineno}, in {f.name}: {(f.line or "").strip()}' for f in frames[-5:]]
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    text = "\n".join([head] + lines)
    return text if len(text) <= TRACEBACK_CHARS else text[: TRACEBACK_CHARS - 3] + "..."


def last_line(exc, filename):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    return frames[-1].lineno if frames else None


def module_namespace(name):
    return {"__name__": f"hook_{name}", "__builtins__": builtins, "HostCallError": HostCallError}


class NoExecute(Exception):
    """The module code ran but left no callable `execute`."""


def run_module(name, compiled):
    """Runs a hook's module code into a fresh namespace; returns its `execute`."""
    namespace = module_namespace(name)
    exec(compiled, namespace)
    execute = namespace.get("execute")
    if not callable(execute):
        raise NoExecute("the code does not define a function execute(context, settings)")
    return execute


def fail(error, line=None):
    raise Err(json.dumps({"error": error, "line": line}))


# The hook this instance was prepared for (`load` or `prepare`): its name, and its `execute` or the
# error its module code raised. An instance serves one call of one hook, then is dropped.
PREPARED = None


def prepare_module(name, compiled):
    """Runs a hook's module code in this instance and keeps what came of it for `call`."""
    global PREPARED
    filename = filename_of(name)
    # The snapshot's generator state is the same in every instance: each instance draws its own
    # seed from the host (WASI random_get), so no two instances share a sequence.
    random.seed()
    try:
        PREPARED = (name, run_module(name, compiled), None, compiled)
    except NoExecute as e:
        PREPARED = (name, None, str(e), compiled)
    except BaseException as e:  # a hook's module code may raise anything, SystemExit included
        PREPARED = (name, None, trimmed_traceback(e, filename), compiled)
        return last_line(e, filename)
    return None


class WitWorld(wit_world.WitWorld):
    def load(self, name, code):
        filename = filename_of(name)
        try:
            compiled = compile(code, filename, "exec", dont_inherit=True)
        except SyntaxError as e:
            fail(f"{type(e).__name__}: {e.msg} (line {e.lineno})", e.lineno)
        except (ValueError, MemoryError, RecursionError) as e:
            fail(f"{type(e).__name__}: {e}")
        line = prepare_module(name, compiled)
        if PREPARED[2] is not None:
            fail(PREPARED[2], line)
        return marshal.dumps(compiled)

    def prepare(self, name, code):
        prepare_module(name, marshal.loads(code))

    def call(self, request_json):
        wit_world.answer(self.answer_of(request_json))

    def answer_of(self, request_json):
        if PREPARED is None:
            return json.dumps({"error": "this instance was not prepared for a hook"})
        name, execute, error, compiled = PREPARED
        if error is not None:
            return json.dumps({"error": error})
        filename = filename_of(name)
        request = json.loads(request_json)
        traced = bool(request.get("trace_s"))
        covered = set()
        answer = {}
        try:
            if traced:
                stop_at_line_after(filename, request["trace_s"], covered)
            ctx = Context(request.get("context") or {})
            ctx["outgoing"] = request.get("outgoing")
            ctx["state"] = request.get("state")
            ctx["hook"] = name
            ctx["host_call"] = host_call
            answer["value"] = execute(ctx, request.get("settings") or {})
        except BaseException as e:  # SystemExit, KeyboardInterrupt, MemoryError: hook errors too
            answer = {"error": trimmed_traceback(e, filename)}
        finally:
            if traced:
                sys.settrace(None)
                answer["lines"] = coverage(compiled, covered)
        try:
            return json.dumps(answer, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            error = {"error": f"execute returned something that is not JSON-serializable: {e}"}
            if traced:
                error["lines"] = answer["lines"]
            return json.dumps(error)


def warm_up():
    """Imports and exercises what hooks commonly use (compile, regex, JSON), so the snapshot holds
    those code paths' caches and every instance finds them warm."""
    import importlib

    for module in STDLIB:
        importlib.import_module(module)
    sample = "import re\nP = re.compile(r'\\d{3}-\\d{4}')\ndef execute(context, settings):\n    return {'action': 'pass'}\n"
    namespace = module_namespace("warm-up")
    exec(compile(sample, "<warm-up>", "exec", dont_inherit=True), namespace)
    json.loads(json.dumps({"outgoing": "call 555-1234 " * 50, "state": [None]}))
    # What a hook prints reaches the supervisor as it is written (unbuffered: an instance stopped at
    # its deadline has nothing left in a buffer), where it is kept, bounded, for the hook's result.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    tmpfs.install()
    # From here on, every import is answered from what the snapshot holds, or refused with a reason.
    sys.meta_path.append(SandboxFinder)


warm_up()

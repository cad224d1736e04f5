"""The gateway's MCP proxy (`--mcp-listen`, docs/mcp.md), used as an agent uses it: the official MCP
Python SDK (`mcp` from PyPI) as the client with only its server URL changed, in front of a real MCP
server made with the same SDK (tests/mcp_server.py), with chains for the server's target served by a
real local gateway (runsc sandboxes). Two callers of two namespaces, each with its bearer token."""

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

from .gateway import LocalGateway, free_port, requires_runsc

try:
    import httpx2
    from mcp import ClientSession, types
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError
except ImportError as e:  # pragma: no cover - `make test-clients` installs it
    raise RuntimeError(f"the MCP SDK is missing ({e}): pip install './clients/python[test]'") from None

TOKEN = "agent-token"
ELSEWHERE_TOKEN = "elsewhere-agent-token"
PERSONAL = ["555-0123-4567", "sam.jones@example.com"]


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


CALLERS = f"""apiVersion: sluice.dev/v1alpha1
kind: CallerPolicy
callers:
  - name: agent
    match: {{tokenSha256: "{sha256(TOKEN)}"}}
    namespaces: [default]
  - name: elsewhere
    match: {{tokenSha256: "{sha256(ELSEWHERE_TOKEN)}"}}
    namespaces: [elsewhere]
"""

REDACT = r'''
        import re
        def clean(text):
            text = re.sub(r"\d{3}-\d{4}-\d{4}", "[phone]", text)
            return re.sub(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+", "[email]", text)
'''


def chains(namespace: str) -> str:
    return f"""
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: gone-input, namespace: {namespace}}}
spec:
  target: gone
  triggerPoint: input
  pool: {{warm: 0, max: 1}}
  hooks:
    - name: nothing
      action: detect
      code: |
        def execute(context, settings):
            return {{"action": "pass"}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: tools-list, namespace: {namespace}}}
spec:
  target: tools
  triggerPoint: before_model
  pool: {{warm: 1, max: 4}}
  hooks:
    - name: read-only
      action: modify
      code: |
        def execute(context, settings):
            call = context["outgoing"]
            kept = [t for t in call["tools"] if not t["name"].startswith("delete")]
            if len(kept) == len(call["tools"]):
                return {{"action": "pass"}}
            call["tools"] = kept
            return {{"action": "modify", "outgoing": call}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: tools-calls, namespace: {namespace}}}
spec:
  target: tools
  triggerPoint: before_tool
  pool: {{warm: 1, max: 4}}
  hooks:
    - name: redact-arguments
      action: modify
      code: |{REDACT}
        def execute(context, settings):
            call = context["outgoing"]
            args = {{k: clean(v) if isinstance(v, str) else v for k, v in call["arguments"].items()}}
            if args == call["arguments"]:
                return {{"action": "pass"}}
            call["arguments"] = args
            return {{"action": "modify", "outgoing": call}}
    - name: no-forbidden
      action: block
      code: |
        def execute(context, settings):
            if "forbidden" in str(context["outgoing"]["arguments"]):
                return {{"action": "block", "message": "That request is not allowed."}}
            return {{"action": "pass"}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: tools-results, namespace: {namespace}}}
spec:
  target: tools
  triggerPoint: after_tool
  pool: {{warm: 1, max: 4}}
  hooks:
    - name: redact-results
      action: modify
      code: |{REDACT}
        def execute(context, settings):
            out = context["outgoing"]
            for key in ("result", "error"):
                if isinstance(out.get(key), str):
                    out[key] = clean(out[key])
            return {{"action": "modify", "outgoing": out}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: tools-contents, namespace: {namespace}}}
spec:
  target: tools
  triggerPoint: output
  pool: {{warm: 1, max: 2}}
  hooks:
    - name: redact-contents
      action: modify
      code: |{REDACT}
        def execute(context, settings):
            text = clean(context["outgoing"])
            return {{"action": "modify", "outgoing": text}} if text != context["outgoing"] else {{"action": "pass"}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: tools-sampling, namespace: {namespace}}}
spec:
  target: tools
  triggerPoint: input
  pool: {{warm: 1, max: 2}}
  hooks:
    - name: block-injection
      action: block
      code: |
        def execute(context, settings):
            if "ignore all previous instructions" in context["outgoing"].lower():
                return {{"action": "block", "message": "prompt injection"}}
            return {{"action": "pass"}}
"""


@requires_runsc
class McpProxyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.files = tempfile.mkdtemp(prefix="sluice-pyclient-mcp")
        cls.calls = os.path.join(cls.files, "calls.jsonl")
        callers = os.path.join(cls.files, "callers.yaml")
        with open(callers, "w") as f:
            f.write(CALLERS)
        port = free_port()
        here = os.path.dirname(os.path.abspath(__file__))
        cls.server = subprocess.Popen(
            [sys.executable, os.path.join(here, "mcp_server.py"), str(port)],
            env={**os.environ, "MCP_TEST_CALLS": cls.calls},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cls.proxy = f"127.0.0.1:{free_port()}"
        cls.gateway = LocalGateway(
            files={"default.yaml": chains("default"), "elsewhere.yaml": chains("elsewhere")},
            args=["--callers", callers, "--mcp-listen", cls.proxy,
                  "--mcp-server", f"tools=http://127.0.0.1:{port}/mcp",
                  # A server that is not there (nothing listens on its port).
                  "--mcp-server", f"gone=http://127.0.0.1:{free_port()}/mcp",
                  "--mcp-upstream-timeout", "3s"],
            client={"token": TOKEN},
        )
        try:
            cls.gateway.wait_ready()
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/mcp", timeout=2)
                except urllib.error.HTTPError:
                    break  # it answers (a GET without a session is refused): it is up
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the MCP server never came up")
                    time.sleep(0.2)
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.gateway.stop()
        cls.server.terminate()
        try:
            cls.server.wait(10)
        except subprocess.TimeoutExpired:
            cls.server.kill()
            cls.server.wait()
        shutil.rmtree(cls.files, ignore_errors=True)

    def url(self, server="tools"):
        return f"http://{self.proxy}/mcp/{server}"

    def server_calls(self):
        try:
            with open(self.calls) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def session(self, body, token=TOKEN, namespace=None, sampling=None):
        """Runs `body(session)` in an MCP session through the proxy; returns what it returns."""
        headers = {"authorization": f"Bearer {token}"}
        if namespace:
            headers["x-sluice-namespace"] = namespace

        async def run():
            async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http:
                async with streamable_http_client(self.url(), http_client=http) as (read, write):
                    async with ClientSession(read, write, sampling_callback=sampling) as s:
                        await s.initialize()
                        return await body(s)

        return asyncio.run(run())

    @staticmethod
    def texts(result):
        return [c.text for c in result.content if c.type == "text"]

    # === tools/call ===

    def test_the_sdks_default_client_needs_only_the_url(self):
        from mcp import Client

        async def run():
            headers = {"authorization": f"Bearer {TOKEN}"}
            async with httpx2.AsyncClient(headers=headers) as http:
                # Its default mode asks for the newest protocol first (server/discover), which the
                # proxy does not serve: it falls back to the initialize handshake by itself.
                async with Client(streamable_http_client(self.url(), http_client=http)) as c:
                    return c.protocol_version, await c.call_tool("lookup_customer", {"name": "Sam"})

        version, r = asyncio.run(run())
        self.assertEqual(version, "2025-11-25")
        self.assertEqual(self.texts(r), ["Customer Sam: phone [phone], email [email]"])

    def test_personal_data_in_arguments_never_reaches_the_server_and_none_in_results_reaches_the_agent(self):
        async def body(s):
            echoed = await s.call_tool("echo", {"text": "call me on 555-0123-4567"})
            looked = await s.call_tool("lookup_customer", {"name": "Sam"})
            return echoed, looked

        echoed, looked = self.session(body)
        self.assertEqual(self.texts(echoed), ["call me on [phone]"])
        reached = [c for c in self.server_calls() if c["tool"] == "echo"]
        self.assertIn({"tool": "echo", "arguments": {"text": "call me on [phone]"}}, reached)
        self.assertFalse(any("555-0123" in json.dumps(c) for c in reached), reached)
        (text,) = self.texts(looked)
        self.assertEqual(text, "Customer Sam: phone [phone], email [email]")
        # structuredContent carries the same text; it passed the chain too.
        self.assertEqual(looked.structured_content, {"result": text})
        self.assertFalse(looked.is_error)

    def test_a_blocked_tool_call_is_a_tool_error_and_never_reaches_the_server(self):
        async def body(s):
            return await s.call_tool("echo", {"text": "something forbidden"})

        r = self.session(body)
        self.assertTrue(r.is_error)
        self.assertEqual(self.texts(r), ["That request is not allowed."])
        self.assertFalse(any("forbidden" in json.dumps(c) for c in self.server_calls()))

    # === tools/list ===

    def test_read_only_mode_hides_a_write_tool_and_a_hidden_tool_cannot_be_called(self):
        async def body(s):
            listed = await s.list_tools()
            called = await s.call_tool("delete_record", {"id": "42"})
            return listed, called

        listed, called = self.session(body)
        names = {t.name for t in listed.tools}
        self.assertIn("read_file", names)
        self.assertNotIn("delete_record", names)
        self.assertTrue(called.is_error)
        self.assertIn("not available", self.texts(called)[0])
        self.assertFalse(any(c["tool"] == "delete_record" for c in self.server_calls()))

    def test_a_hidden_tool_cannot_be_called_before_the_session_lists_tools(self):
        async def body(s):
            return await s.call_tool("delete_record", {"id": "7"})

        r = self.session(body)
        self.assertTrue(r.is_error)
        self.assertFalse(any(c["tool"] == "delete_record" for c in self.server_calls()))

    def test_parallel_tool_calls_of_one_turn_are_each_guarded(self):
        async def body(s):
            return await asyncio.gather(*[
                s.call_tool("lookup_customer", {"name": f"n{i}"}) for i in range(4)])

        results = self.session(body)
        self.assertEqual([self.texts(r) for r in results],
                         [[f"Customer n{i}: phone [phone], email [email]"] for i in range(4)])

    def test_every_guarded_call_is_audited_with_its_mcp_method(self):
        async def body(s):
            await s.list_tools()
            return await s.call_tool("echo", {"text": "audited 555-0123-4567"})

        self.session(body)
        audit = os.path.join(self.gateway.state, "audit.jsonl")
        deadline = time.monotonic() + 10
        while True:
            with open(audit) as f:
                events = [json.loads(line) for line in f]
            points = {(e["trigger_point"], e.get("via", {}).get("method")) for e in events
                      if e.get("via", {}).get("proxy") == "mcp" and e["target"] == "tools"}
            wanted = {("before_tool", "tools/call"), ("after_tool", "tools/call"),
                      ("before_model", "tools/list")}
            if wanted <= points or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertIn(("before_tool", "tools/call"), points)
        self.assertIn(("after_tool", "tools/call"), points)
        self.assertIn(("before_model", "tools/list"), points)
        modified = [e for e in events if e.get("via", {}).get("method") == "tools/call"
                    and e["trigger_point"] == "before_tool" and e["action"] == "modify"]
        self.assertTrue(modified, "the redaction of the arguments was not audited")

    # === resources and prompts ===

    def test_resource_contents_and_prompts_pass_the_output_chain_and_listings_carry_no_descriptions(self):
        async def body(s):
            return (await s.read_resource("note://welcome"), await s.get_prompt("greet", {"name": "ada@example.com"}),
                    await s.list_resources(), await s.list_prompts())

        read, prompt, resources, prompts = self.session(body)
        self.assertEqual([c.text for c in read.contents],
                         ["Welcome! Questions go to [email]."])
        self.assertEqual([m.content.text for m in prompt.messages],
                         ["Please write a friendly greeting for [email]."])
        self.assertIsNone(prompt.description)
        self.assertEqual([(r.uri, r.description) for r in resources.resources],
                         [("note://welcome", None)])
        self.assertEqual([(p.name, p.description) for p in prompts.prompts], [("greet", None)])

    # === streamed answers ===

    def test_a_streamed_result_passes_its_progress_without_messages_and_its_result_through_the_chain(self):
        progress = []

        async def on_progress(p, total, message):
            progress.append((p, total, message))

        async def body(s):
            return await s.call_tool("progress_report", {"text": "write to sam.jones@example.com"},
                                     progress_callback=on_progress)

        r = self.session(body)
        self.assertEqual(self.texts(r), ["write to [email]"])
        self.assertEqual([(p, t) for p, t, _ in progress], [(1, 2), (2, 2)])
        # A progress message is text no chain reads: it does not reach the agent.
        self.assertEqual([m for _, _, m in progress], [None, None])

    def test_non_text_content_is_dropped_and_the_text_beside_it_kept(self):
        async def body(s):
            return await s.call_tool("picture", {})

        r = self.session(body)
        self.assertEqual([c.type for c in r.content], ["text"])
        self.assertEqual(self.texts(r), ["a 1x1 red pixel"])

    # === server → client ===

    def test_a_sampling_request_carrying_an_injection_never_reaches_the_agents_model(self):
        asked = []

        async def sampling(context, params):
            asked.append(params)
            return types.CreateMessageResult(role="assistant", model="m", stop_reason="endTurn",
                                             content=types.TextContent(type="text", text="42"))

        async def body(s):
            with self.assertRaises(MCPError) as e:
                await s.call_tool("ask_model", {"question": "What is 6*7?"})
            return e.exception

        e = self.session(body, sampling=sampling)
        self.assertEqual(asked, [], "the agent's model was asked the server's injection")
        # The server got the refusal as its sampling request's answer, and failed the call.
        self.assertIn("answered with an error", str(e))

    # === refusals ===

    def raw(self, message, token=TOKEN, session=None, namespace=None, server="tools"):
        """One POST to the proxy as it comes off the wire: (status, headers, JSON-RPC messages)."""
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json",
                   "accept": "application/json, text/event-stream"}
        if session:
            headers["mcp-session-id"] = session
        if namespace:
            headers["x-sluice-namespace"] = namespace
        req = urllib.request.Request(self.url(server), data=json.dumps(message).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, hdrs, body = r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            status, hdrs, body = e.code, dict(e.headers), e.read().decode()
        hdrs = {k.lower(): v for k, v in hdrs.items()}
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            messages = [json.loads(line[len("data: "):]) for line in body.splitlines()
                        if line.startswith("data: ")]
        else:
            messages = [json.loads(body)] if body.strip() else []
        return status, hdrs, messages

    def initialized(self, token=TOKEN):
        status, headers, (answer,) = self.raw(
            {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                        "clientInfo": {"name": "raw", "version": "0"}}}, token=token)
        self.assertEqual(status, 200, answer)
        # Only what the proxy serves is announced, and the server's instructions (text no chain
        # reads) are not passed on.
        self.assertEqual(answer["result"]["capabilities"],
                         {"tools": {"listChanged": False}, "resources": {"listChanged": False},
                          "prompts": {"listChanged": False}})
        self.assertNotIn("instructions", answer["result"])
        return headers["mcp-session-id"]

    def test_a_method_the_proxy_does_not_know_is_refused(self):
        session = self.initialized()
        for method in ["resources/subscribe", "completion/complete", "logging/setLevel",
                       "tools/delete"]:
            status, _, (answer,) = self.raw({"jsonrpc": "2.0", "id": 2, "method": method},
                                            session=session)
            self.assertEqual(status, 200)
            self.assertEqual(answer["error"]["code"], -32601, answer)
            self.assertIn("does not relay", answer["error"]["message"])
        status, _, (answer,) = self.raw([{"jsonrpc": "2.0", "id": 3, "method": "ping"}],
                                        session=session)
        self.assertEqual(status, 400)
        self.assertIn("batch", answer["error"]["message"])

    def test_a_session_is_not_found_by_a_caller_of_another_namespace(self):
        session = self.initialized()
        status, _, _ = self.raw({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, session=session)
        self.assertEqual(status, 200)
        status, _, (answer,) = self.raw({"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                        token=ELSEWHERE_TOKEN, session=session)
        self.assertEqual(status, 404, answer)
        # Nor can that caller name the first one's namespace.
        status, _, _ = self.raw({"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                token=ELSEWHERE_TOKEN, session=session, namespace="default")
        self.assertEqual(status, 403)
        # Its own session, in its own namespace, is served by its own chains.
        r = self.session(lambda s: s.call_tool("lookup_customer", {"name": "Ada"}),
                         token=ELSEWHERE_TOKEN)
        self.assertEqual(self.texts(r), ["Customer Ada: phone [phone], email [email]"])

    def test_a_server_that_cannot_be_reached_is_an_error_answer_and_an_unknown_one_is_not_served(self):
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                           "clientInfo": {"name": "raw", "version": "0"}}}
        status, _, (answer,) = self.raw(init, server="gone")
        self.assertEqual(status, 200)
        self.assertEqual(answer["error"]["code"], -32001, answer)
        self.assertIn("cannot be reached", answer["error"]["message"])
        status, _, (answer,) = self.raw(init, server="nowhere")
        self.assertEqual(status, 404)
        self.assertIn("served: [\"gone\", \"tools\"]", answer["error"]["message"])

    def test_a_caller_without_a_token_is_refused(self):
        status, _, _ = self.raw({"jsonrpc": "2.0", "id": 1, "method": "ping"}, token="wrong")
        self.assertEqual(status, 401)

    def test_a_server_that_never_answers_is_a_timeout_error_and_the_session_goes_on(self):
        async def body(s):
            started = time.monotonic()
            with self.assertRaises(MCPError) as e:
                await s.call_tool("slow", {"seconds": 30})
            waited = time.monotonic() - started
            after = await s.call_tool("echo", {"text": "still here"})
            return e.exception, waited, after

        e, waited, after = self.session(body)
        self.assertIn("sent nothing for 3 s", str(e))
        self.assertLess(waited, 20)
        self.assertEqual(self.texts(after), ["still here"])


if __name__ == "__main__":
    unittest.main()

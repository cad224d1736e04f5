"""The asyncio client against the real local gateway: run and the agent-loop points, streams fed
by an async generator (commits, block, final), and errors mapped as in the sync client."""

import asyncio
import unittest

from sluice_client import Action, Blocked, Commit, Final, InvalidArgument, NotFound
from sluice_client.aio import AsyncClient

from .gateway import requires_runsc, shared


@requires_runsc
class AsyncClientTest(unittest.IsolatedAsyncioTestCase):
    @classmethod
    def setUpClass(cls):
        cls.address = shared().address  # started outside the event loop: it blocks while booting

    async def asyncSetUp(self):
        self.client = AsyncClient(self.address, timeout=60)
        await self.client.wait_ready(60)

    async def asyncTearDown(self):
        await self.client.close()

    async def test_run_and_agent_loop_points(self):
        r = await self.client.run("support-bot", "input", "call me at 010-1234-5678")
        self.assertIs(r.action, Action.MODIFY)
        self.assertEqual(r.text, "call me at [phone]")
        r = await self.client.before_model("agent", model="m", messages=[], tools=[{"name": "write_file"}], turn=9)
        self.assertIs(r.action, Action.BLOCK)
        self.assertEqual(r.message, "turn limit reached")
        r = await self.client.before_tool("agent", name="read_file", arguments={"path": "../x"}, context={"user": "eve"})
        self.assertEqual(r.message, "eve: ../x is outside the project")
        r = await self.client.after_tool("agent", name="cat", result="password", error=None)
        self.assertEqual(r.payload["result"], "[redacted]")
        r = await self.client.after_model("agent", message={"role": "assistant", "content": "no secret"})
        self.assertIs(r.action, Action.DETECT)

    async def test_stream_from_an_async_generator(self):
        async def model():
            for text in ["Sure, call me at 010-", "1234-5678 any time ", "this week."]:
                await asyncio.sleep(0)
                yield text

        events = [e async for e in self.client.stream("support-bot", model())]
        self.assertIsInstance(events[-1], Final)
        committed = "".join(e.text for e in events if isinstance(e, Commit))
        self.assertNotIn("1234-5678", committed)
        self.assertEqual(events[-1].result.text, "Sure, call me at [phone] any time this week.")

    async def test_stream_block_and_result(self):
        s = self.client.stream("support-bot", ["a FORBIDDEN thing, ", "and more text after it"])
        r = await s.result()
        self.assertIs(r.action, Action.BLOCK)
        self.assertEqual(s.blocked, Blocked(message="The reply was withheld.", hook="no-forbidden"))
        self.assertNotIn("FORBIDDEN", s.committed)

    async def test_a_stream_refused_at_open_reports_the_gateways_status(self):
        # The gateway refuses at `open` while chunks are still being written; grpc.aio's own stream
        # call can then report INTERNAL instead (grpc/grpc#36066). Repeated to give the race room.
        chunks = [f"chunk {i} " for i in range(200)]
        for _ in range(20):
            with self.assertRaises(NotFound):
                await self.client.stream("no-such-bot", chunks).result()

    async def test_errors_are_mapped(self):
        with self.assertRaises(NotFound):
            await self.client.run("no-such-bot", "input", "hi")
        with self.assertRaises(InvalidArgument):
            await self.client.run("support-bot", "sideways", "hi")
        with self.assertRaises(NotFound):
            await self.client.stream("no-such-bot", ["hi"]).result()

        async def broken():
            yield "some words "
            raise ConnectionError("model stream broke")

        with self.assertRaises(ConnectionError):
            await self.client.stream("support-bot", broken()).result()


if __name__ == "__main__":
    unittest.main()

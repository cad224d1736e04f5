"""The README's example runs as it is, against a real gateway serving `examples/` (what
`make run` serves), and prints what the README says it does."""

import os
import re
import subprocess
import sys
import unittest

from .gateway import REPO, LocalGateway, requires_runsc

README = os.path.join(REPO, "clients", "python", "README.md")


def first_python_block() -> str:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)[0]


@requires_runsc
class ReadmeTest(unittest.TestCase):
    def test_the_example_runs_against_the_examples_chains(self):
        code = first_python_block()
        self.assertIn('"127.0.0.1:50051"', code)
        # Few warm sandboxes: the example touches four of the chains, the others need not boot.
        gateway = LocalGateway(serve=os.path.join(REPO, "examples"), args=["--max-warm-sandboxes", "4"])
        try:
            gateway.wait_ready()
            out = subprocess.run(
                [sys.executable, "-c", code.replace("127.0.0.1:50051", gateway.address)],
                capture_output=True, text=True, timeout=300,
            )
        finally:
            gateway.stop()
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertIn("send to the agent: call me at [phone]", lines)
        self.assertIn("  redact-phone: modify ", lines)
        streamed = next(line for line in lines if line.startswith("You can reach"))
        self.assertEqual(streamed, "You can reach our office at [phone] or [phone], any weekday.")
        self.assertIn("persist: You can reach our office at [phone] or [phone], any weekday.", lines)
        self.assertIn("tools offered: ['read_file']", lines)
        self.assertIn("write_file: block Read-only mode: the tool 'write_file' may not run.", lines)
        self.assertTrue(any(line.startswith("no chain: ") and "no-such-bot" in line for line in lines), lines)


if __name__ == "__main__":
    unittest.main()

"""The cluster suite's driver (e2e/cluster/test.sh) fails the run when taking the cluster down leaves
something behind, whatever the suites said: run here with stand-ins for the cluster, its images and
its install (the real ones are `make test-cluster`'s), so that the check itself can be seen to fail."""

import os
import shutil
import subprocess
import tempfile
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

CLUSTER_SH = """#!/bin/sh
case "$1" in
  up) exit 0 ;;
  down) if [ -n "$LEAK" ]; then echo "cluster.sh: pod sandbox-x left behind" >&2; exit 1; fi; exit 0 ;;
esac
"""


class TestShTest(unittest.TestCase):
    def run_suite(self, leak: bool, suite_fails: bool = False):
        d = tempfile.mkdtemp(prefix="sluice-test-sh")
        self.addCleanup(shutil.rmtree, d, True)
        shutil.copy(os.path.join(REPO, "e2e", "cluster", "test.sh"), d)
        for name, text in (("cluster.sh", CLUSTER_SH), ("images.sh", "#!/bin/sh\nexit 0\n"),
                           ("install.sh", "#!/bin/sh\nexit 0\n")):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(d, name), 0o755)
        os.mkdir(os.path.join(d, "state"))
        open(os.path.join(d, "state", "e2e.env"), "w").close()
        env = {**os.environ, "SLUICE_CLUSTER_STATE": os.path.join(d, "state"), "SLUICE_SKIP_UPGRADE": "1",
               "CARGO": "false" if suite_fails else "true"}
        env.pop("LEAK", None)
        if leak:
            env["LEAK"] = "1"
        return subprocess.run(["bash", os.path.join(d, "test.sh")], env=env, capture_output=True, text=True,
                              timeout=60)

    def test_a_clean_run_passes(self):
        out = self.run_suite(leak=False)
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_a_leftover_after_the_suites_passed_fails_the_run(self):
        out = self.run_suite(leak=True)
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("left something behind", out.stderr)

    def test_a_failed_suite_keeps_its_status_when_the_cluster_also_leaks(self):
        out = self.run_suite(leak=True, suite_fails=True)
        self.assertNotEqual(out.returncode, 0, out.stderr)


if __name__ == "__main__":
    unittest.main()

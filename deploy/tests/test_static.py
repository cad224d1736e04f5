"""Static checks of the packaging (standard library only): the CRD copies never drift from crds/, and
the Dockerfiles, Makefile and chart values keep the contract's images, paths and non-root users."""

import filecmp
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGISTRY = "ghcr.io/sluice-dev"
IMAGES = {  # image -> Dockerfile
    "sluice-supervisor": "supervisor/Dockerfile",
    "sluice-operator": "deploy/docker/operator.Dockerfile",
    "sluice-gateway": "deploy/docker/gateway.Dockerfile",
}


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def final_stage(dockerfile):
    """Instructions of the last stage, comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", read(dockerfile))
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    start = max(i for i, l in enumerate(lines) if l.upper().startswith("FROM "))
    return lines[start:]


def instructions(stage, keyword):
    return [l.split(None, 1)[1] for l in stage if l.split(None, 1)[0].upper() == keyword]


class CrdCopiesTest(unittest.TestCase):
    def test_chart_and_kustomize_crds_are_identical_to_crds(self):
        sources = sorted(f for f in os.listdir(os.path.join(ROOT, "crds")) if f.endswith(".yaml"))
        self.assertEqual(sources, ["capability.yaml", "hookchain.yaml"])
        for copy_dir in ("charts/sluice/crds", "deploy/base/crds"):
            copies = sorted(os.listdir(os.path.join(ROOT, copy_dir)))
            self.assertEqual(copies, sources, f"{copy_dir} holds other files than crds/*.yaml")
            for name in sources:
                self.assertTrue(
                    filecmp.cmp(os.path.join(ROOT, "crds", name), os.path.join(ROOT, copy_dir, name), shallow=False),
                    f"{copy_dir}/{name} differs from crds/{name}: copy it again (make deploy-base copies both)")


class DockerfileTest(unittest.TestCase):
    def test_every_image_runs_as_uid_65534(self):
        for image, dockerfile in IMAGES.items():
            users = instructions(final_stage(dockerfile), "USER")
            self.assertEqual(users[-1:], ["65534:65534"], f"{dockerfile}: the final stage must end as USER 65534:65534")

    def test_supervisor_image_matches_the_contract(self):
        stage = final_stage("supervisor/Dockerfile")
        self.assertTrue(stage[0].startswith("FROM debian:bookworm-slim"), stage[0])
        copies = " ".join(instructions(stage, "COPY"))
        for f in ("/opt/sluice/sluice-supervisor", "sluice-cell.cwasm", "sluice-cell.cwasm.sha256"):
            self.assertIn(f, copies)
        self.assertNotIn("SLUICE_", " ".join(instructions(stage, "ENV")), "settings are flags, not the environment")
        self.assertEqual(
            instructions(stage, "CMD"),
            ['["/opt/sluice/sluice-supervisor", "--listen", "--runtime", "/opt/sluice/sluice-cell.cwasm"]'],
        )
        for f in ("guest/runner.py", "wit/cell.wit", "build-cell.sh"):
            self.assertTrue(os.path.exists(os.path.join(ROOT, "supervisor", f)))

    def test_operator_and_gateway_are_multi_stage_and_run_their_binary(self):
        # Both check hook code with the CPython the sandboxes run: the supervisor and its cell runtime
        # sit beside their binary, and the runtime stage has no Python of its own.
        for name in ("operator", "gateway"):
            dockerfile = IMAGES[f"sluice-{name}"]
            text = read(dockerfile)
            self.assertIn("cargo build --release --locked --workspace --bins", text)
            self.assertIn("supervisor/build-cell.sh release", text)
            stage = final_stage(dockerfile)
            self.assertTrue(stage[0].startswith("FROM debian:bookworm-slim"), f"{dockerfile}: runtime stage {stage[0]!r}")
            self.assertNotIn("python", " ".join(stage).lower(), f"{dockerfile}: a Python in the runtime stage")
            copies = " ".join(instructions(stage, "COPY"))
            for file in (f"/out/sluice-{name}", "/out/sluice-supervisor", "/out/sluice-cell.cwasm", "/out/sluice-cell.cwasm.sha256"):
                self.assertIn(file, copies, dockerfile)
            self.assertEqual(instructions(stage, "ENTRYPOINT"), [f'["/usr/local/bin/sluice-{name}"]'])

    def test_dockerignore_keeps_build_output_out_of_the_context(self):
        ignored = read(".dockerignore").split()
        for entry in ("target", ".git", ".venv-tools"):
            self.assertIn(entry, ignored)

    def test_make_images_builds_the_three_contract_images(self):
        makefile = read("Makefile")
        self.assertRegex(makefile, r"REGISTRY \?= ghcr\.io/sluice-dev")
        for image, dockerfile in IMAGES.items():
            self.assertIn(f"-f {dockerfile} -t $(REGISTRY)/{image}:$(TAG) .", makefile)

    def test_chart_values_name_the_contract_images(self):
        values = read("charts/sluice/values.yaml")
        self.assertIn(f"registry: {REGISTRY}\n", values)
        for image in IMAGES:
            self.assertIn(f"repository: {image}\n", values)


if __name__ == "__main__":
    unittest.main()

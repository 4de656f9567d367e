"""What a plain server's process loads: every server, replica, rank and worker starts one, so a heavy
import nothing uses costs every start (torch's compiler over a second, Ray a third of one)."""
import subprocess
import sys

STARTUP_SCRIPT = """
import sys
import hypic.cli, hypic.server
from hypic import Engine
Engine.from_pretrained("default").generate("Hello there. How are you? Fine, thanks.", max_new_tokens=2)
print(sorted(name for name in sys.modules if name.startswith(("torch._dynamo", "ray"))))
"""


def test_a_server_that_loads_the_model_and_generates_imports_neither_torchs_compiler_nor_ray() -> None:
    run = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"

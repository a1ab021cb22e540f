"""dtrain.launch.node.quick_exit: a process run through run_then_exit ends with the status and output
`python -m` gives, its atexit handlers and logging run, and the interpreter's own teardown is skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""\
    import atexit, logging, sys
    from dtrain.launch.node.quick_exit import run_then_exit

    class Sentinel:
        # the interpreter's teardown clears this module and prints; run_then_exit ends the process first
        def __del__(self):
            sys.stdout.write("teardown ran\\n")
            sys.stdout.flush()

    keep = Sentinel()
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
    logging.basicConfig(stream=sys.stderr, format="log: %(message)s")
""")


def run(body: str) -> subprocess.CompletedProcess:
    source = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("body, status, stderr_has", [
    ("def main():\n    print('done')\n", 0, []),
    ("def main():\n    print('done')\n    sys.exit(3)\n", 3, []),
    ("def main():\n    print('done')\n    sys.exit(None)\n", 0, []),
    ("def main():\n    print('done')\n    sys.exit(256 + 7)\n", 7, []),
    ("def main():\n    print('done')\n    sys.exit('the agent cannot sign its rendezvous')\n", 1,
     ["the agent cannot sign its rendezvous"]),
    ("def main():\n    print('done')\n    raise RuntimeError('boom in the agent')\n", 1,
     ["Traceback (most recent call last)", "RuntimeError: boom in the agent"]),
], ids=["returns", "exit-3", "exit-none", "exit-263", "exit-text", "raises"])
def test_the_status_and_output_are_the_interpreters_and_its_teardown_is_skipped(body, status, stderr_has):
    done = run(body + "logging.getLogger('agent').warning('buffered record')\n"
                      "sys.stdout.write('unflushed tail')\n"
                      "run_then_exit(main)\n"
                      "print('never here')\n")
    assert done.returncode == status, done
    # stdout is a pipe (block-buffered): what main printed and the unflushed tail came out; nothing
    # after run_then_exit ran, nor the interpreter's teardown ("teardown ran")
    assert done.stdout == "unflushed taildone\n", done
    assert "atexit ran" in done.stderr and "log: buffered record" in done.stderr, done
    for text in stderr_has:
        assert text in done.stderr, done


def test_the_same_program_without_it_does_run_the_teardown():
    """The sentinel above is seen by the interpreter's teardown: its absence means something."""
    done = run("print('done')\n")
    assert done.returncode == 0 and "teardown ran" in done.stdout and "atexit ran" in done.stderr, done


def test_the_torchrun_agent_ends_through_it():
    """`python -m dtrain.launch.node.torchrun_agent` (what every backend starts) ends through run_then_exit:
    torchrun's ``--help`` keeps its output and status 0, and the interpreter's teardown never runs."""
    source = PRELUDE + textwrap.dedent("""\
        import runpy
        sys.argv = ["torchrun_agent", "--help"]
        runpy.run_module("dtrain.launch.node.torchrun_agent", run_name="__main__", alter_sys=True)
        """)
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--nproc-per-node" in done.stdout, done
    assert "teardown ran" not in done.stdout and "atexit ran" in done.stderr, done

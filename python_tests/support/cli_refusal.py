"""Running ``verl-fast`` in the test's process and reading its refusal: exit status 2, one line on
stderr (what ``verl_fast.errors`` prints), no traceback."""

import traceback
from typing import List


def refusal(argv: List[str], capsys) -> str:
    """The stderr line of ``verl-fast argv``, which must refuse (exit 2) without a traceback; an
    exception escaping the command (what would print a traceback) fails the test with it."""
    from verl_fast.cli.main import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors (exit 2, "usage: ..." and the error on stderr)
        code = e.code
    except Exception:  # noqa: BLE001 - shown as the traceback the user would have seen
        raise AssertionError(f"verl-fast {' '.join(argv)} ended in a traceback:\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1] if err.strip() else ""

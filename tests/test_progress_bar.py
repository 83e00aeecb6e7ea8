"""The Trainer's progress bar off a terminal (issue 11, section 5): under `lockstep launch` stderr is a
pipe, and the bar must still show, as whole lines, the step time and the communication share."""

from __future__ import annotations

import io

from lockstep.train.progress import progress_bar, step_postfix


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_forwarded_bar_writes_lines_with_step_time_and_comm_share():
    out = Pipe()
    bar = progress_bar(total=4, initial=0, desc="epoch 0", enabled=True, stream=out, forwarded_interval_s=0)
    for step in range(4):
        bar.set_postfix(step_postfix(0.5, 1000.0, 0.0123, 0.25), refresh=False)
        bar.update(1)
    bar.close()
    lines = [line for line in out.getvalue().split("\n") if line]
    assert "\r" not in out.getvalue()
    assert len(lines) >= 3, lines  # one line per refresh, not one carriage-returned line at the end
    assert all(line.startswith("epoch 0:") for line in lines)
    assert "4/4" in lines[-1] and "step_ms=12.3" in lines[-1] and "comm=25%" in lines[-1]


def test_bar_is_silent_when_disabled_and_on_other_ranks():
    out = Pipe()
    bar = progress_bar(total=4, initial=0, desc="epoch 0", enabled=False, stream=out, forwarded_interval_s=0)
    bar.update(4)
    bar.close()
    assert out.getvalue() == ""


def test_postfix_without_comm_account():
    assert "comm" not in step_postfix(1.0, 10.0, 0.5, None)


def test_epoch_shorter_than_the_interval_still_shows_its_last_line():
    out = Pipe()
    bar = progress_bar(total=3, initial=0, desc="epoch 1", enabled=True, stream=out, forwarded_interval_s=60)
    for _ in range(3):
        bar.set_postfix(step_postfix(0.5, 10.0, 0.002, 0.5), refresh=False)
        bar.update(1)
    bar.close()
    lines = [line for line in out.getvalue().split("\n") if line]
    assert len(lines) == 1 and lines[0].startswith("epoch 1: 3/3 steps") and "comm=50%" in lines[0], lines

"""Progress output (issue 11, part 5): plain lines when stderr is not a terminal, a bar on one,
nothing when quiet."""

from __future__ import annotations

import io

import pytest

from picompile.progress import library_bars, progress_bar


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a console's stderr does."""

    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_plain_lines_at_a_tenth_of_the_work_each(capsys):
    assert list(progress_bar(range(100), "calibrating")) == list(range(100))
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert lines[:3] == ["picompile: calibrating: 10/100 (10%)",
                         "picompile: calibrating: 20/100 (20%)",
                         "picompile: calibrating: 30/100 (30%)"]
    assert len(lines) == 10  # 9 intermediate lines and the final one
    assert lines[-1].startswith("picompile: calibrating: 100/100 done in ")


def test_few_steps_get_a_line_each_and_a_generator_a_start_and_an_end(capsys):
    list(progress_bar(["a", "b", "c"], "training predictors"))
    list(progress_bar((i for i in range(5)), "profiling"))
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["picompile: training predictors: 1/3 (33%)",
                         "picompile: training predictors: 2/3 (67%)"]
    assert lines[2].startswith("picompile: training predictors: 3/3 done in ")
    assert lines[3] == "picompile: profiling: started"
    assert lines[4].startswith("picompile: profiling: 5 steps done in ") and len(lines) == 5


def test_an_explicit_total_is_used_for_an_iterable_without_length():
    out = io.StringIO()
    list(progress_bar(iter(range(4)), "layers", total=4, file=out))
    assert out.getvalue().splitlines()[1] == "picompile: layers: 2/4 (50%)"


def test_a_terminal_keeps_the_live_bar():
    tty = Terminal()
    list(progress_bar(range(50), "calibrating", file=tty))
    assert "\r" in tty.getvalue() and "picompile: calibrating" in tty.getvalue()


@pytest.mark.parametrize("tty", [False, True])
def test_quiet_prints_nothing(tty, capsys, monkeypatch):
    out = Terminal() if tty else io.StringIO()
    assert list(progress_bar(range(20), "calibrating", quiet=True, file=out)) == list(range(20))
    monkeypatch.setenv("PICOMPILE_QUIET", "1")
    assert list(progress_bar(range(20), "calibrating", file=out)) == list(range(20))
    assert out.getvalue() == "" and capsys.readouterr().err == ""


def test_hugging_face_bars_are_off_into_a_pipe_and_back_on_after(capsys):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with library_bars():  # stderr is pytest's capture, not a terminal
        assert not hf_logging.is_progress_bar_enabled()
        list(hf_logging.tqdm(range(5), desc="Loading weights"))
    assert hf_logging.is_progress_bar_enabled()
    assert "Loading weights" not in capsys.readouterr().err


def test_plain_tqdm_bars_of_libraries_are_dropped_into_a_pipe_and_other_lines_kept(capsys):
    """transformers' GGUF loader draws a plain tqdm bar whatever disable_progress_bar() says."""
    import sys

    from tqdm.auto import tqdm

    with library_bars():
        list(tqdm(range(300), desc="Converting and de-quantizing GGUF tensors...",
                  mininterval=0))
        print("a warning on the way", file=sys.stderr)
    print("after", file=sys.stderr)
    assert capsys.readouterr().err == "a warning on the way\nafter\n"

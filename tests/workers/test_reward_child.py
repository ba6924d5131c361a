"""The reward child process: length-prefixed msgpack frames, and its serve loop."""

import io
import subprocess
import sys

from areal_fast.workers.reward_child import read_message, write_message


class Trickle(io.RawIOBase):
    """A raw stream that returns at most 3 bytes per read, like a pipe under load."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def readable(self):
        return True

    def read(self, size=-1):
        return self._data.read(min(size, 3) if size >= 0 else 3)


def test_frame_is_an_8_byte_big_endian_length_then_msgpack():
    out = io.BytesIO()
    write_message(out, "hi")
    assert out.getvalue() == (3).to_bytes(8, "big") + b"\xa2hi"


def test_frames_round_trip_and_end():
    out = io.BytesIO()
    write_message(out, (["a", "b"], [{"uid": "u", "x": 1.5}]))
    write_message(out, ("ok", [1.0, 0.0]))
    data = out.getvalue()
    stream = Trickle(data)
    assert read_message(stream) == [["a", "b"], [{"uid": "u", "x": 1.5}]]  # tuples → lists
    assert read_message(stream) == ["ok", [1.0, 0.0]]
    assert read_message(stream) is None  # end of stream


def test_a_cut_frame_reads_as_the_end():
    out = io.BytesIO()
    write_message(out, "a long enough message")
    assert read_message(io.BytesIO(out.getvalue()[:-2])) is None
    assert read_message(io.BytesIO(out.getvalue()[:5])) is None


def test_child_scores_calls_and_reports_errors(tmp_path):
    reward = tmp_path / "rw.py"
    reward.write_text(
        "def score(completion, sample):\n"
        "    print('noise on stdout')\n"
        "    return float(completion == sample['answer'])\n"
    )
    jobs = io.BytesIO()
    write_message(jobs, (["4"], [{"answer": "4"}]))  # one sample per call (not batched)
    write_message(jobs, (["5"], [{"answer": "4"}]))
    write_message(jobs, (["4"], [{}]))  # no "answer": the reward raises KeyError
    proc = subprocess.run(
        [sys.executable, "-m", "areal_fast.workers.reward_child", f"{reward}:score"],
        input=jobs.getvalue(),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    replies = io.BytesIO(proc.stdout)  # the prints went to stderr, not into the frames
    assert read_message(replies) == ["ready", None]
    assert read_message(replies) == ["ok", [1.0]]
    assert read_message(replies) == ["ok", [0.0]]
    status, text = read_message(replies)
    assert status == "error" and text.startswith("KeyError")
    assert read_message(replies) is None
    assert b"noise on stdout" in proc.stderr


def test_child_reports_a_reward_that_does_not_load(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "areal_fast.workers.reward_child", f"{tmp_path}/none.py:f"],
        input=b"",
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 1
    status, text = read_message(io.BytesIO(proc.stdout))
    assert status == "failed" and "none.py" in text

"""CPU tests of :mod:`batch_invariance_kit.vllm.online`, the online check, without vLLM.

The plan (seeded requests and times, closed-loop clients), the parsing of the server's answers (log-probabilities kept
as the server's literals), the bitwise comparison, and the whole experiment against a stand-in
server process (``tests/fake_openai_server.py``): started in its own process group, ready on
``/health``, a streamed target and a cancelled neighbour, the checks passing on an invariant
server and catching a batch-variant one, every target beside busy clients however late it starts, the
clients stopping once the targets are done, the group stopped.  The live run on vLLM's CPU build
is chapter 7's."""
import itertools
import json
import sys
from pathlib import Path

import pytest

from batch_invariance_kit.vllm import online as O
from batch_invariance_kit.vllm import records as RC

TESTS = Path(__file__).resolve().parent


def test_parse_choice_keeps_the_literals_and_join():
    text = ('{"choices": [{"text": "ab", "finish_reason": "length", "logprobs": {"tokens": ["token_id:5", '
            '"token_id:7"], "token_logprobs": [-0.10000000149011612, -2.5], "top_logprobs": '
            '[{"token_id:9": -3.0, "token_id:5": -0.10000000149011612}, {"token_id:7": -2.5}]}}]}')
    a = O.parse_choice(json.loads(text, parse_float=str)["choices"][0])
    assert a.tokens == (5, 7) and a.logprobs == ("-0.10000000149011612", "-2.5")
    assert a.top == (((5, "-0.10000000149011612"), (9, "-3.0")), ((7, "-2.5"),)) and a.finish_reason == "length"
    parts = [O.Answer((5,), ("-1.0",), (((5, "-1.0"),),), "a"), O.Answer((), (), (), ""),
             O.Answer((6,), ("-2.0",), (((6, "-2.0"),),), "b", "length")]
    j = O.join(parts)
    assert j.tokens == (5, 6) and j.logprobs == ("-1.0", "-2.0") and j.text == "ab" and j.finish_reason == "length"
    with pytest.raises(ValueError, match="token_id"):
        O.token_id("hello")
    with pytest.raises(ValueError, match="token_logprobs"):
        O.parse_choice({"logprobs": {"tokens": ["token_id:1"], "token_logprobs": [], "top_logprobs": [None]}})


def test_a_malformed_reply_names_the_field():
    ok = {"text": "a", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": ["-1.0"], "top_logprobs": [None]}}
    assert O.first_choice({"choices": [ok], "usage": {}}).tokens == (5,)      # fields it does not read: ignored
    with pytest.raises(ValueError, match=r"^r\.choices: expected a non-empty list"):
        O.first_choice({"object": "error", "message": "boom"}, "r")
    bad = {**ok, "logprobs": {**ok["logprobs"], "token_logprobs": [-1.0]}}     # a float: not parsed as a literal
    with pytest.raises(ValueError, match=r"^r\.choices\[0\]\.logprobs\.token_logprobs\[0\]: expected str"):
        O.first_choice({"choices": [bad]}, "r")
    bad = {**ok, "logprobs": {**ok["logprobs"], "tokens": ["token_id:x"]}}
    with pytest.raises(ValueError, match=r"^r\.choices\[0\]\.logprobs\.tokens\[0\]: expected a 'token_id:N'"):
        O.first_choice({"choices": [bad]}, "r")
    with pytest.raises(ValueError, match=r"^r\.choices\[0\]\.logprobs: expected an object"):
        O.first_choice({"choices": [{"logprobs": []}]}, "r")


def test_compare_is_bitwise_on_the_literals():
    a = O.Answer((1, 2, 3), ("-0.5", "-1.25", "-2.0"), ((), (), ()))
    c = O.compare_answers(a, a)
    assert c.bitwise and c.first_token_diff is None and c.first_logprob_diff is None and c.max_abs_diff == 0.0
    b = O.Answer((1, 2, 3), ("-0.5", "-1.2500001", "-2.0"), ((), (), ()))
    c = O.compare_answers(a, b)
    assert c.tokens_equal and not c.logprobs_equal and not c.bitwise and c.first_logprob_diff == 1
    assert 0 < c.max_abs_diff < 1e-6
    c = O.compare_answers(a, O.Answer((1, 2), ("-0.5", "-1.25"), ((), ())))   # shorter: a difference
    assert not c.tokens_equal and c.first_token_diff == 2 and c.first_logprob_diff == 2
    top = O.compare_answers(a, O.Answer(a.tokens, a.logprobs, (((4, "-3.0"),), (), ())))
    assert top.tokens_equal and top.logprobs_equal and not top.top_equal and not top.bitwise


def test_plan_is_seeded_and_checked():
    p = O.Plan(targets=[[3, 4, 5], [6, 7]], clients=3, per_client=2, rounds=2, vocab=100, seed=1)
    r0, r0b, r1 = p.round(0), O.Plan(targets=[[3, 4, 5], [6, 7]], clients=3, per_client=2, rounds=2, vocab=100,
                                       seed=1).round(0), p.round(1)
    assert r0 == r0b and r0 != r1
    assert sorted(q.name for q in r0.requests) == ["cancel", "stream", "t0", "t1"]
    assert [q.at for q in r0.requests] == sorted(q.at for q in r0.requests)
    assert len(r0.starts) == 3 and all(0 <= t <= p.window_s / 2 for t in r0.starts)
    by = {q.name: q for q in r0.requests}
    assert all(min(r0.starts) <= by[n].at <= 0.9 * p.window_s for n in ("t0", "t1", "stream"))   # beside a client
    assert by["t1"].prompt == (6, 7) and by["t1"].target == 1 and by["stream"].stream and by["stream"].target == 0
    assert by["cancel"].cancel_after == 2 and by["cancel"].target is None
    sent = list(r0.requests) + [q for c in range(3) for q in itertools.islice(p.client(0, c), 20)]
    assert all(2 <= t < 100 for q in sent for t in q.prompt)
    assert p.max_model_len >= max(len(q.prompt) + q.max_tokens for q in sent)
    with pytest.raises(TypeError, match="targets"):
        O.Plan(targets=[])
    with pytest.raises(ValueError, match="clients"):
        O.Plan(targets=[[1]], clients=0)
    with pytest.raises(ValueError, match="prompt_len"):
        O.Plan(targets=[[1]], prompt_len=(5, 2))
    named = O.Plan(targets=[[3, 4, 5], [6, 7]], names=("target", "needle"), clients=1, per_client=1)
    assert {q.name for q in named.round(0).requests} == {"target", "needle", "stream", "cancel"}
    with pytest.raises(ValueError, match="names"):
        O.Plan(targets=[[1], [2]], names=("stream", "x"))


def test_a_clients_kth_request_is_seeded():
    """A client's requests are drawn on demand from its own generator: the k-th is the same for the
    same seed, round and client however many are drawn, whatever the other clients do."""
    kw = dict(targets=[[3, 4, 5]], clients=3, per_client=2, rounds=2, vocab=100)
    p = O.Plan(seed=4, **kw)
    five = list(itertools.islice(p.client(1, 2), 5))
    assert [q.name for q in five] == [f"c2.{k}" for k in range(5)]
    assert all(q.at == p.round(1).starts[2] and q.target is None and not q.stream for q in five)
    assert list(itertools.islice(O.Plan(seed=4, **kw).client(1, 2), 3)) == five[:3]
    assert all(p.prompt_len[0] <= len(q.prompt) <= p.prompt_len[1] and p.new_tokens[0] <= q.max_tokens
               <= p.new_tokens[1] for q in five)
    others = [next(O.Plan(seed=5, **kw).client(1, 2)), next(p.client(0, 2)), next(p.client(1, 1))]
    assert all(q.prompt != five[0].prompt for q in others)


def test_server_env_and_command():
    env = O.server_env("kit", gpu=False, report_dir="/r", base={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert env["KIT_BATCH_INVARIANT"] == "1" and env["TRITON_INTERPRET"] == "1" and env["KIT_PLUGIN_REPORT"] == "/r"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    env = O.server_env("default", gpu=True, report_dir="/r", base={})
    assert env["KIT_BATCH_INVARIANT"] == "0" and "TRITON_INTERPRET" not in env and "KIT_PLUGIN_REPORT" not in env
    cmd = O.server_command("/m", 1234, max_model_len=300, top_logprobs=5, eager=True, gpu=False, tokenizer=False)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd
    assert "--skip-tokenizer-init" in cmd and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--logprobs-mode") + 1] == "raw_logprobs" and "--no-enable-prefix-caching" in cmd


def _fake(tmp_path, *args):
    port = O.free_port()
    cmd = [sys.executable, str(TESTS / "fake_openai_server.py"), "--port", str(port), *args]
    return O.Server(cmd, {"PATH": "/usr/bin:/bin"}, tmp_path / "server.log")


@pytest.mark.parametrize("variant", [False, True])
def test_experiment_against_a_stand_in_server(tmp_path, variant):
    import httpx

    plan = O.Plan(targets=[[5, 6, 7], [8, 9]], max_tokens=6, clients=4, per_client=2, rounds=1,
                  prompt_len=(2, 6), new_tokens=(4, 12), window_s=0.4, top_logprobs=3, vocab=50)
    srv = _fake(tmp_path, "--start-s", "0.5", *(["--variant"] if variant else []))
    with srv:
        assert srv.wait_ready(30) >= 0.5
        res = O.experiment(srv.base_url, plan, timeout_s=30, healthy=srv.healthy)
        stats = httpx.get(srv.base_url + "/stats").json()
    assert srv.proc.returncode is not None and not srv.healthy()
    assert stats["aborted"] == 1 and res["healthy_after"]     # the cancelled stream, and the server went on
    r = res["rounds"][0]
    assert r["cancelled"]["cancelled"] and r["cancelled"]["tokens"] == 2 < r["cancelled"]["max_tokens"]
    loaded = [c for c in res["copies"] if c["round"] == 0]
    assert sorted(c["name"] for c in loaded) == ["stream", "t0", "t1"] and res["copies"][-1]["round"] == "after"
    assert all(c["in_flight_beside"] > 0 for c in loaded)
    kit = {c["name"].split(": ", 1)[1]: c for c in O.checks("m", "kit", res, platform="cpu",
                                                           plugin_calls={"linear": 1, "rms_norm": 1})}
    default = O.checks("m", "default", res, platform="cuda")
    assert len(kit) == 5 and default[0]["copies"] == 3
    if variant:   # the same checks catch a batch-variant server
        assert not kit[next(k for k in kit if k.startswith("2 target copies"))]["passed"]
        assert default[0]["passed"] and default[0]["differs"] and default[0]["max_abs_diff"] > 0
    else:
        assert all(c["passed"] for c in kit.values()), kit
        assert not default[0]["passed"] and not default[0]["differs"]
    rows = O.rows_of("kit", "m", res)
    assert [x.round for x in rows] == [0, 0, 0, "after"] and all(isinstance(x, RC.OnlineRow) for x in rows)
    back = RC.read({"provenance": {}, "rows": [RC.to_dict(x) for x in rows], "checks": []})
    assert back.rows == rows and all(x.compared.bitwise is (not variant) for x in rows[:3])


def _late_targets_plan():
    """Clients whose replies take 20 ms (one token at the stand-in's 0.02 s a token), targets that
    start more than 0.2 s after every client's first request: open-loop clients, each sending its
    one request, would be done before any target starts."""
    plan = O.Plan(targets=[[5, 6, 7], [8, 9]], max_tokens=4, clients=2, per_client=1, rounds=1, prompt_len=(2, 4),
                  new_tokens=(1, 1), window_s=2.0, top_logprobs=2, vocab=50, seed=4)
    rnd = plan.round(0)
    assert all(q.at > max(rnd.starts) + 0.2 for q in rnd.requests if q.target is not None)
    return plan


def test_targets_that_start_late_run_beside_busy_clients(tmp_path):
    plan = _late_targets_plan()
    with _fake(tmp_path) as srv:
        srv.wait_ready(30)
        res = O.experiment(srv.base_url, plan, timeout_s=30, healthy=srv.healthy)
    loaded = [c for c in res["copies"] if c["round"] == 0]
    assert sorted(c["name"] for c in loaded) == ["stream", "t0", "t1"]
    assert all(c["in_flight_beside"] > 0 for c in loaded), loaded
    assert all(n > plan.per_client for n in res["rounds"][0]["neighbours"]["per_client"])   # kept sending


def test_clients_stop_once_the_targets_are_done(tmp_path):
    plan = _late_targets_plan()
    reqs = plan.round(0).requests
    with _fake(tmp_path) as srv:
        srv.wait_ready(30)
        sent = O.run_sync(O.run_requests(srv.base_url, "model", reqs, 2, 30,
                                         tuple(plan.client(0, c) for c in range(plan.clients)), at_least=3))
    fixed, load = sent[:len(reqs)], sent[len(reqs):]
    assert [s.name for s in fixed] == [q.name for q in reqs] and not any(s.error for s in sent)
    done = max(s.end for s in fixed)
    for c in range(plan.clients):
        mine = [s for s in load if s.name.startswith(f"c{c}.")]
        assert [s.name for s in mine] == [f"c{c}.{k}" for k in range(len(mine))] and len(mine) >= 3
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))           # one after another
        assert sum(s.start > done for s in mine[3:]) <= 1                      # none begun once the targets are done
        assert mine[-1].end >= done or len(mine) == 3


def test_run_sync_inside_a_running_loop():
    """A notebook's kernel runs an event loop: the clients still run there (in a thread of their own)."""
    import asyncio

    async def two():
        return 2

    async def inside():
        return O.run_sync(two())

    assert O.run_sync(two()) == 2 and asyncio.run(inside()) == 2


def test_server_that_exits_or_hangs(tmp_path):
    srv = O.Server([sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)", "--port", "1"], {},
                   tmp_path / "a.log")
    with srv, pytest.raises(RuntimeError, match="(?s)exited with code 3.*no such model"):
        srv.wait_ready(30)
    srv = _fake(tmp_path, "--start-s", "60")
    with srv, pytest.raises(RuntimeError, match="not ready within 2 s"):
        srv.wait_ready(2)
    assert srv.proc.returncode is not None   # the group was stopped


def test_checks_of_a_server_that_did_not_start():
    (c,) = O.checks("m", "kit", {"error": "RuntimeError: the server exited with code 1\nValueError: no memory"},
                    platform="cpu")
    assert not c["passed"] and not c["informational"] and c["error"] == "ValueError: no memory"
    (c,) = O.checks("m", "default", {"error": "boom"}, platform="cpu")
    assert not c["passed"] and c["informational"]


def test_main_rejects_bad_arguments(capsys, tmp_path):
    assert O.main(["--out", str(tmp_path), "--model", str(tmp_path), "--modes", "kit"]) == 2
    assert "--model must be a local Hugging Face folder" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert O.main(["--out", str(tmp_path), "--model", str(tmp_path), "--modes", "fast"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert O.main(["--out", str(tmp_path), "--model", str(tmp_path), "--clients", "0"]) == 2
    assert "--clients" in capsys.readouterr().err


HAS_VLLM = __import__("importlib.util").util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh)")
def test_kit_server_is_bitwise_under_concurrent_clients(tmp_path):
    """vLLM's CPU build serving SmolLM2-135M-Instruct with the kit's plugin: 2 targets alone, then
    among 4 clients of random lengths and times, a streamed copy and a cancelled neighbour; every
    copy bitwise its answer alone, the server still serving after the cancellation."""
    import torch

    from batch_invariance_kit.serving import smollm2
    from batch_invariance_kit.vllm import chat
    from transformers import AutoTokenizer

    if torch.cuda.is_available():
        pytest.skip("the CPU build's test; on a GPU run python -m batch_invariance_kit.vllm.online")
    model = smollm2.prepare()
    tok = AutoTokenizer.from_pretrained(model)
    plan = O.Plan(targets=[chat.encode(tok, q) for q in chat.TARGETS[:2]], max_tokens=8, clients=4, per_client=2,
                  rounds=1, prompt_len=(8, 96), new_tokens=(2, 16), window_s=3.0, top_logprobs=5,
                  vocab=tok.vocab_size)
    res = O.run_mode(model, "kit", plan, tmp_path, eager=True, gpu=False, start_timeout_s=420, timeout_s=300)
    assert not res.get("error"), res.get("error")
    cs = O.checks("smollm2", "kit", res, platform="cpu", plugin_calls=(res.get("plugin") or {}).get("calls"))
    assert len(cs) == 5 and all(c["passed"] for c in cs), cs
    neighbours = res["rounds"][0]["neighbours"]
    assert res["server"]["exit_code"] is not None and min(neighbours["per_client"]) >= 2
    assert neighbours["sent"] == sum(neighbours["per_client"]) + 1   # and the cancelled one

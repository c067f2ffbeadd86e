"""LangChain against ``minicb serve``: ``with_structured_output`` 20 out of 20, and ``bind_tools``.

    pip install langchain-openai            # pulls no torch
    python bench/langchain_check.py         # a few minutes on 2 shared cores
    python bench/langchain_check.py --runs 5 --url http://127.0.0.1:8000/v1   # a server already up

Starts ``minicb serve`` (SmolLM2-135M-Instruct, float32) on a free port, unless ``--url`` names one,
then with ``langchain_openai.ChatOpenAI(base_url=..., api_key=..., model=...)``:

1. ``.with_structured_output(Person)`` (a pydantic model; LangChain sends ``response_format:
   json_schema``) on ``--runs`` different prompts, each with ``temperature=0.8`` and its own ``seed``,
   all at once (from threads: the server batches them); counts the valid ``Person`` objects returned;
2. ``.bind_tools([GetWeather, ConvertCurrency], tool_choice="GetWeather")`` (a forced, named tool
   choice) and ``tool_choice="any"`` (OpenAI's ``required``): each must return a parsed tool call
   whose ``args`` validate against the tool's pydantic model.

Exits non-zero unless every structured output is valid and every forced call parses.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from pydantic import BaseModel, Field

ROOT = pathlib.Path(__file__).resolve().parents[1]

PEOPLE = ["Alice is 30 and lives in Paris.", "Bob, aged 45, is a baker from Lyon.",
          "Carmen (27) works as a nurse in Madrid.", "Dmitri is a 52-year-old pilot based in Riga.",
          "Emeka lives in Lagos; he turned 38 last week.", "Fatima, 61, teaches maths in Casablanca.",
          "Gustav is twenty-two and studies in Oslo.", "Hana is a 34-year-old architect in Kyoto.",
          "Ivan, 19, plays chess in Kazan.", "Julia is a 41-year-old lawyer in Vienna.",
          "Kofi (29) is a farmer near Kumasi.", "Lena, 56, runs a bakery in Hamburg.",
          "Mateo is 24 and surfs in Lima.", "Nadia, a 33-year-old doctor, lives in Tunis.",
          "Oscar is a retired sailor of 70 from Porto.", "Priya, 26, codes in Bangalore.",
          "Quentin is 48 and sells wine in Bordeaux.", "Rosa, 37, paints in Mexico City.",
          "Sven is a 65-year-old fisherman in Bergen.", "Tomoko, 23, dances in Osaka."]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")
    city: str = Field(description="the city they live in")


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city, e.g. Paris")
    unit: str = Field(description="celsius or fahrenheit")


class ConvertCurrency(BaseModel):
    """Convert an amount of money from one currency to another."""

    amount: float
    source: str
    target: str


def start_server() -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "minicb", "serve", "--port", "0", "--served-model-name", "smollm2",
           "--max-num-seqs", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on http" not in line:
        raise SystemExit(f"minicb serve did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split()[0] + "/v1"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--url", default=None, help="a running server's /v1 URL (default: start one)")
    args = ap.parse_args(argv)
    from langchain_openai import ChatOpenAI

    proc, url = (None, args.url) if args.url else start_server()
    try:
        print(f"server: {url}")
        ok = True
        # 1. with_structured_output, varied prompts, temperature > 0, a seed each
        chains = [ChatOpenAI(base_url=url, api_key="none", model="smollm2", temperature=0.8, seed=i,
                             max_tokens=120, timeout=900).with_structured_output(Person)
                  for i in range(args.runs)]
        prompts = [f"Extract the person from this text as JSON.\n\n{PEOPLE[i % len(PEOPLE)]}"
                   for i in range(args.runs)]
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(args.runs) as pool:
            futures = [pool.submit(_try, c.invoke, p) for c, p in zip(chains, prompts)]
            results = [f.result() for f in futures]
        valid = sum(isinstance(r, Person) for r in results)
        for p, r in zip(prompts, results):
            print(f"  {p.splitlines()[-1]:<52} -> {r!r}")
        print(f"with_structured_output(Person): {valid}/{args.runs} valid objects")
        ok &= valid == args.runs
        # 2. bind_tools with a forced tool choice
        llm = ChatOpenAI(base_url=url, api_key="none", model="smollm2", temperature=0, max_tokens=120,
                         timeout=900)
        for choice, question, tool in [("GetWeather", "What's the weather like in Berlin?", GetWeather),
                                       ("any", "How many yen is 250 euros?", ConvertCurrency)]:
            msg = llm.bind_tools([GetWeather, ConvertCurrency], tool_choice=choice).invoke(question)
            calls = msg.tool_calls
            print(f"bind_tools(tool_choice={choice!r}) on {question!r}: {calls}")
            if not calls:
                ok = False
                continue
            model = {"GetWeather": GetWeather, "ConvertCurrency": ConvertCurrency}[calls[0]["name"]]
            parsed = _try(model.model_validate, calls[0]["args"])
            print(f"  parsed: {parsed!r}" + ("" if choice == "any" or model is tool else "  (wrong tool!)"))
            ok &= isinstance(parsed, model) and (choice == "any" or model is tool)
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


def _try(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - an invalid output is counted, and shown
        return e


if __name__ == "__main__":
    sys.exit(main())

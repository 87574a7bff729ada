"""Write the bundled demo mix: regen_service/demo/mix.yaml and its data in regen_service/demo/data/.

About 200 synthetic prompts (original text made from the phrase banks below, seeded, so reruns give the
same bytes) in all five formats and three file types, with a handful of planted bad rows that the
producer must quarantine (wrong types, missing fields, empty conversation, unknown role, invalid JSON,
unequal pretokenized lengths) and one prompt repeated across two sources (dedup). The pretokenized rows
are rendered with the demo tokenizer, so run scripts/build_demo_tokenizer.py first (it also trains on
`corpus_texts()` from this module).

Run: python scripts/make_demo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "regen_service" / "demo"
DATA = DEMO / "data"

SUBJECTS = [
    "tide pools", "sourdough bread", "binary search", "solar panels", "bicycle gears", "compound interest",
    "volcanoes", "hash tables", "houseplants", "the water cycle", "chess openings", "recursion",
    "paper airplanes", "caching", "rainbows", "garden compost", "unit tests", "lighthouses",
    "prime numbers", "public libraries", "version control", "bird migration", "espresso", "regular expressions",
]  # fmt: skip
ASKS = [
    "Explain {s} to a curious ten-year-old.",
    "Give me three surprising facts about {s}.",
    "What is the most common mistake people make with {s}?",
    "Write a four-line poem about {s}.",
    "Compare {s} with {t} in a short paragraph.",
    "How would you teach {s} in fifteen minutes?",
    "Summarize the history of {s} in two sentences.",
    "List the pros and cons of learning about {s} before {t}.",
]
ANSWERS = [
    "Think of {s} as a small system with a few moving parts; once you see how they connect, the rest follows.",
    "Here is a short answer: {s} works because each step builds on the one before it.",
    "The key idea behind {s} is balance: too little or too much both cause trouble.",
    "Start with a concrete example of {s}, then name the pattern, then let the learner try it.",
]
FOLLOWUPS = ["Can you make that shorter?", "Why does that matter?", "Give an example, please.", "And {t}?"]
CHINESE = ["请用三句话介绍{s}。", "关于{s}，初学者应该先了解什么？", "为什么{s}很重要？"]
SYSTEMS = ["You are a patient tutor.", "Answer in plain language.", "You are a concise assistant.", ""]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart"]
WEATHER_TOOL = {
    "name": "get_forecast",
    "description": "Get tomorrow's weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CONVERT_TOOL = {
    "name": "convert_units",
    "description": "Convert a value between units",
    "parameters": {
        "type": "object",
        "properties": {"value": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
        "required": ["value", "from", "to"],
    },
}


def _fill(rng: random.Random, template: str) -> str:
    s, t = rng.sample(SUBJECTS, 2)
    return template.format(s=s, t=t)


def sharegpt_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(44):
        turns = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            turns.append({"from": "human", "value": _fill(rng, rng.choice(ASKS + FOLLOWUPS))})
            turns.append({"from": "gpt", "value": _fill(rng, rng.choice(ANSWERS))})
        row: dict = {"id": f"demo-sg-{i}", "conversations": turns}
        if i % 7 == 0:
            row["system"] = rng.choice(SYSTEMS[:-1])  # top-level system key
        elif i % 7 == 1:
            turns.insert(0, {"from": "system", "value": rng.choice(SYSTEMS[:-1])})  # system turn
        rows.append(row)
    for i in range(6):  # function_call / observation conversations, tools as a JSON string
        city = CITIES[i % len(CITIES)]
        call = {"name": "get_forecast", "arguments": {"city": city}}
        turns = [
            {"from": "human", "value": f"Should I pack an umbrella for {city} tomorrow?"},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": json.dumps({"city": city, "rain_mm": i * 3, "high_c": 14 + i})},
            {
                "from": "gpt",
                "value": f"Expect about {i * 3} mm of rain in {city}; an umbrella is {'wise' if i else 'optional'}.",
            },
        ]
        rows.append({"conversations": turns, "tools": json.dumps([WEATHER_TOOL])})
    return rows


def messages_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(36):
        msgs = []
        if i % 4 == 0:
            msgs.append(
                {"role": "developer" if i % 8 == 0 else "system", "content": rng.choice(SYSTEMS[:-1])}
            )
        ask = _fill(rng, rng.choice(CHINESE if i % 5 == 0 else ASKS))
        if i % 9 == 0:  # list-of-parts content with an image part that is dropped
            msgs.append(
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "file://demo.png"}, {"type": "text", "text": ask}],
                }
            )
        else:
            msgs.append({"role": "user", "content": ask})
        msgs.append(
            {
                "role": "assistant",
                "content": _fill(rng, rng.choice(ANSWERS)),
                "reasoning_content": "Keep it short.",
            }
        )
        rows.append({"messages": msgs})
    for i in range(14):  # tool calls with object arguments, tool messages with and without ids
        value = 3 + i
        call_id = f"call_{i}" if i % 2 else None
        call = {
            "type": "function",
            "function": {"name": "convert_units", "arguments": {"value": value, "from": "km", "to": "mi"}},
        }
        if call_id:
            call["id"] = call_id
        tool_msg = {"role": "tool", "content": json.dumps({"result": round(value * 0.621371, 3)})}
        if call_id:
            tool_msg["tool_call_id"] = call_id
        msgs = [
            {"role": "user", "content": f"How many miles is {value} km?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            tool_msg,
            {"role": "assistant", "content": f"{value} km is about {value * 0.621371:.2f} miles."},
        ]
        rows.append(
            {
                "messages": msgs,
                "tools": [
                    {"type": "function", "function": CONVERT_TOOL},
                    {"type": "function", "function": WEATHER_TOOL},
                ],
            }
        )
    return rows


def instruction_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(40):
        s, t = rng.sample(SUBJECTS, 2)
        row = {
            "instruction": rng.choice(
                ["Rewrite the text for a beginner.", "Classify the topic of the text.", f"Explain {s}."]
            ),
            "input": "" if i % 3 == 0 else f"A note about {s} and {t}: both reward patience.",
            "output": _fill(rng, rng.choice(ANSWERS)),
        }
        if i % 10 == 0:
            row["system"] = "You write for a school newsletter."
        rows.append(row)
    return rows


def prompt_response_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(30):
        s, t = SUBJECTS[i % len(SUBJECTS)], SUBJECTS[(i * 5 + 1) % len(SUBJECTS)]
        prompt = f"Read note {i + 1} and answer.\n\nNote: {s} are easier to understand with an example.\nQuestion: what helps with {s} and {t}?\n"
        completion = "An example." + ("<|endoftext|>" if i % 2 == 0 else "")
        rows.append({"prompt": prompt, "completion": completion})
    return rows


def corpus_texts() -> list[str]:
    """Every text of the conversational demo rows (the tokenizer trains on these)."""
    rng = random.Random(7)
    out: list[str] = []
    for rows in (sharegpt_rows(rng), messages_rows(rng), instruction_rows(rng), prompt_response_rows(rng)):
        out.extend(json.dumps(r, ensure_ascii=False) for r in rows)
    out.extend(SYSTEMS + [f"{a} {b}" for a in SUBJECTS for b in CITIES])
    # every template with every subject pair, so the vocabulary covers what the demo can say
    for template in ASKS + ANSWERS + FOLLOWUPS + CHINESE:
        out.extend(template.format(s=s, t=t) for s in SUBJECTS for t in SUBJECTS if s != t)
    return out


def pretokenized_rows(rng: random.Random) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    rows = []
    for _ in range(25):
        prompt = [{"role": "user", "content": _fill(rng, rng.choice(ASKS))}]
        answer = _fill(rng, rng.choice(ANSWERS))
        head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        head_ids = tok(head, add_special_tokens=False)["input_ids"]
        # the generation prompt ends with "<think>": a short thought, then the answer and the eos
        tail_ids = tok(f"Plan the answer.</think>{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(
            {"input_ids": head_ids + tail_ids, "loss_mask": [0] * len(head_ids) + [1] * len(tail_ids)}
        )
    return rows


BAD = {
    "sharegpt": [
        {
            "conversations": [
                {"from": "narrator", "value": "Once upon a time."},
                {"from": "gpt", "value": "Go on."},
            ]
        },
        {"conversations": []},
        {"conversations": [{"from": "human", "value": 42}]},
    ],
    "messages": [{"messages": "hello"}, {"msgs": [{"role": "user", "content": "typo in the key"}]}],
    "instruction": [{"input": "no instruction here", "output": "x"}],
    "prompt_response": [{"prompt": None, "completion": "orphan"}],
    "pretokenized": [
        {"input_ids": [1, 2, "3"], "loss_mask": [0, 1, 1]},
        {"input_ids": [1, 2, 3], "loss_mask": [1]},
    ],
}

MIX = """# The bundled demo mix: ~200 synthetic prompts in all five formats (written by scripts/make_demo_data.py).
name: demo
target:
  model: moonshotai/Kimi-K2.5
  api: generate
  tokenizer: tokenizer
sampling:
  temperature: 1.0
  top_p: 0.95
  max_new_tokens: 256
shard_size: 32
seed: 0
sources:
  - {name: chat_sharegpt, path: data/chat_sharegpt.jsonl, format: sharegpt}
  - {name: tools_messages, path: data/tools_messages.jsonl, format: messages}
  - {name: alpaca, path: data/alpaca.json, format: instruction}
  - {name: reading_qa, path: data/reading_qa.parquet, format: prompt_response, fields: {response: completion}}
  - {name: pretok, path: data/pretokenized.jsonl, format: pretokenized}
"""


def _jsonl(path: Path, rows: list[dict], bad_lines: tuple[str, ...] = ()) -> None:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows] + list(bad_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    sharegpt, messages = sharegpt_rows(rng), messages_rows(rng)
    instruction, prompt_response = instruction_rows(rng), prompt_response_rows(rng)
    # One prompt that also appears in the alpaca source: dedup keeps the first (alpaca comes first).
    instruction.append({"instruction": prompt_response[0]["prompt"], "input": "", "output": "An example."})
    pretok = pretokenized_rows(random.Random(11))
    DATA.mkdir(parents=True, exist_ok=True)
    # Bad rows are spread through the files, not only at the end, so row indices in the quarantine mean something.
    _jsonl(DATA / "chat_sharegpt.jsonl", sharegpt[:10] + BAD["sharegpt"] + sharegpt[10:], ("{not json",))
    _jsonl(DATA / "tools_messages.jsonl", messages[:5] + BAD["messages"] + messages[5:])
    (DATA / "alpaca.json").write_text(
        json.dumps(instruction[:3] + BAD["instruction"] + instruction[3:], ensure_ascii=False, indent=1)
        + "\n",
        encoding="utf-8",
    )
    pq.write_table(
        pa.Table.from_pylist(prompt_response + BAD["prompt_response"]), DATA / "reading_qa.parquet"
    )
    _jsonl(DATA / "pretokenized.jsonl", pretok[:4] + BAD["pretokenized"] + pretok[4:])
    (DEMO / "mix.yaml").write_text(MIX, encoding="utf-8")
    total = len(sharegpt) + len(messages) + len(instruction) + len(prompt_response) + len(pretok)
    print(f"wrote {DATA} ({total} good rows, {sum(map(len, BAD.values())) + 1} bad) and {DEMO / 'mix.yaml'}")


if __name__ == "__main__":
    main()

"""Build the scaled-down Kimi-K2.5 model folder (no download): python scripts/build_kimi_fixture.py OUT_DIR

The folder is what regen_service.kimi_fixture.build_kimi_fixture writes (tests build it into their
tmp_path the same way): config.json (kimi_k25, auto_map, DeepSeek-V3-style text_config), the slow
tiktoken tokenizer as remote code, and chat_template.jinja. Loading it needs the remote-code opt-in
(`target.trust_remote_code: true` in a mix, `regen train --trust-remote-code`). docs/kimi-k25.md
lists what it reproduces and the public source of each behaviour.
"""

from __future__ import annotations

import sys

from regen_service.kimi_fixture import build_kimi_fixture

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[0])
    print(build_kimi_fixture(sys.argv[1]))

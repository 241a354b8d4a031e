"""The README's numbers about the committed CPU report all come from its results.json."""

import json
import re
from pathlib import Path

from plusequals.bench.results import NUMBER
from report_tokens import tokens

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- numbers: (\S+) .*?-->(.*?)<!-- /numbers -->", re.S)


def test_every_number_in_a_numbers_block_is_in_its_results_json():
    readme = (REPO / "README.md").read_text()
    blocks = BLOCK.findall(readme)
    assert blocks, "no <!-- numbers: ... --> block in README.md"
    for source, text in blocks:
        allowed = tokens(json.loads((REPO / source).read_text()), set(), us=True)
        prose = re.sub(r"`[^`]*`", "", text)  # variant names (eager/op_plus_x, cpp/loop) are not numbers
        stray = [n for n in NUMBER.findall(prose) if n not in allowed]
        assert not stray, f"README numbers not in {source}: {stray}"

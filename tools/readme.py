#!/usr/bin/env python
"Render README.md from nbs/index.ipynb (nbdev_readme needs quarto, which cannot be installed here)."
import json, sys
from pathlib import Path

def render(nb_path:Path) -> str:
    "Markdown cells as they are, code cells as python blocks followed by their text output; hidden cells left out"
    out = []
    for c in json.loads(nb_path.read_text())['cells']:
        src = ''.join(c['source'])
        if c['cell_type'] == 'markdown': out.append(src); continue
        lines = src.splitlines()
        if any(l.startswith('#|') and ('hide' in l or 'default_exp' in l) for l in lines): continue
        out.append('```python\n' + '\n'.join(l for l in lines if not l.startswith('#|')) + '\n```')
        text = ''.join(''.join(o.get('text', '')) or ''.join(o.get('data', {}).get('text/plain', '')) for o in c.get('outputs', []))
        if text.strip(): out.append('```\n' + text.rstrip() + '\n```')
    return '<!-- Generated from nbs/index.ipynb by tools/readme.py: edit the notebook, not this file. -->\n\n' + '\n\n'.join(out) + '\n'

if __name__ == '__main__':
    root = Path(__file__).parent.parent
    (root/'README.md').write_text(render(root/'nbs'/'index.ipynb'))

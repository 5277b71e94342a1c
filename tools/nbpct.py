#!/usr/bin/env python
"Convert nbdev notebooks to and from percent-format scripts, so notebooks can be edited from the terminal."
import hashlib, json, re, sys
from pathlib import Path

MD, CODE = '# %% [markdown]', '# %%'

def pct2nb(src:Path, dst:Path):
    "Write the notebook `dst` from the percent script `src`, keeping outputs of unchanged code cells."
    old, old_ids = {}, {}
    if dst.exists():
        for c in json.loads(dst.read_text())['cells']:
            old_ids.setdefault(''.join(c['source']), c.get('id'))
            if c['cell_type'] == 'code': old[''.join(c['source'])] = c.get('outputs', [])
    cells, kind, buf = [], None, []
    def flush():
        if kind is None: return
        text = '\n'.join(buf).strip('\n')
        if kind == 'markdown': text = '\n'.join(re.sub(r'^# ?', '', l) for l in text.split('\n'))
        src_lines = [l + '\n' for l in text.split('\n')]
        if src_lines: src_lines[-1] = src_lines[-1].rstrip('\n')
        # nbdev names cells by id in the exported modules: an unchanged cell keeps its id, a new one gets a stable one
        cid = old_ids.get(text)
        if not cid or cid in {c['id'] for c in cells}: cid = hashlib.sha1(f'{len(cells)}:{text}'.encode()).hexdigest()[:8]
        cell = dict(cell_type=kind, id=cid, metadata={}, source=src_lines)
        if kind == 'code': cell.update(execution_count=None, outputs=old.get(text, []))
        cells.append(cell)
    for line in src.read_text().split('\n'):
        if line.strip() in (MD, CODE):
            flush(); kind, buf = ('markdown' if line.strip() == MD else 'code'), []
        else: buf.append(line)
    flush()
    nb = dict(cells=cells, metadata=dict(kernelspec=dict(display_name='python3', language='python', name='python3')),
              nbformat=4, nbformat_minor=5)
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + '\n')

def nb2pct(src:Path, dst:Path):
    "Write the percent script `dst` from the notebook `src`."
    out = []
    for c in json.loads(src.read_text())['cells']:
        text = ''.join(c['source'])
        if c['cell_type'] == 'markdown':
            out += [MD] + ['# ' + l if l else '#' for l in text.split('\n')]
        else: out += [CODE, text]
        out.append('')
    dst.write_text('\n'.join(out))

def add_ids(path:Path):
    "Give every cell of the notebook at `path` that has none a stable id"
    nb = json.loads(path.read_text())
    for i, c in enumerate(nb['cells']):
        if not c.get('id'): c['id'] = hashlib.sha1(f"{i}:{''.join(c['source'])}".encode()).hexdigest()[:8]
    nb['nbformat'], nb['nbformat_minor'] = 4, max(nb.get('nbformat_minor', 5), 5)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + '\n')

if __name__ == '__main__':
    if sys.argv[1:2] == ['--add-ids']:
        for p in sys.argv[2:]: add_ids(Path(p))
        sys.exit()
    if len(sys.argv) != 3: sys.exit('usage: nbpct.py SRC DST  (one of them .ipynb, the other .py)')
    a, b = map(Path, sys.argv[1:])
    (pct2nb if b.suffix == '.ipynb' else nb2pct)(a, b)

"""Emulates what PyTorch's memory visualizer (torch/utils/viz/MemoryViz.js: annotate_snapshot,
MemoryView.simulate_memory + draw) and torch/cuda/_memory_viz.py (segsum) do with a snapshot,
and reports the first place they would crash or misdraw. Exit 0 = ok, 1 = problem (printed)."""
import gzip, pickle, sys

def load(p):
    raw = open(p, 'rb').read()
    if raw[:2] == b'\x1f\x8b':
        raw = gzip.decompress(raw)
    return pickle.loads(raw)

def fail(msg):
    print('VIZ-FAIL: ' + msg)
    sys.exit(1)

snap = load(sys.argv[1])
device = int(sys.argv[2]) if len(sys.argv) > 2 else 0

# --- structure / tiling (annotate_snapshot recomputes b.addr from the segment address) ---
for si, seg in enumerate(snap['segments']):
    addr = seg['address']
    for b in seg['blocks']:
        if b['address'] != addr:
            fail(f'segment {si} @{seg["address"]:#x}: block address {b["address"]:#x} != tiled {addr:#x}')
        if b['state'] not in ('active_allocated', 'active_pending_free', 'inactive'):
            fail(f'bad state {b["state"]}')
        if b['size'] <= 0:
            fail(f'segment {si}: block of size {b["size"]}')
        addr += b['size']
    if addr != seg['address'] + seg['total_size']:
        fail(f'segment {si} @{seg["address"]:#x}: blocks cover {addr - seg["address"]} of {seg["total_size"]}')
    alloc = sum(b['size'] for b in seg['blocks'] if b['state'] == 'active_allocated')
    act = sum(b['size'] for b in seg['blocks'] if b['state'] != 'inactive')
    req = sum(b['requested_size'] for b in seg['blocks'] if b['state'] != 'inactive')
    if (alloc, act, req) != (seg['allocated_size'], seg['active_size'], seg['requested_size']):
        fail(f'segment {si}: sizes {(seg["allocated_size"], seg["active_size"], seg["requested_size"])} != {(alloc, act, req)}')
    for b in seg['blocks']:
        if b['state'] != 'inactive' and b['requested_size'] > b['size']:
            fail(f'block {b["address"]:#x}: requested {b["requested_size"]} > size {b["size"]}')

# --- segsum's asserts ---
tr = ta = fe = fi = 0
for seg in snap['segments']:
    tr += seg['total_size']
    for b in seg['blocks']:
        if b['state'] == 'active_allocated':
            ta += b['requested_size']; fi += b['size'] - b['requested_size']
        else:
            fe += b['size']
if fi + fe + ta != tr:
    fail('segsum assertion')

# --- annotate_snapshot ---
stream_names = {0: 0}
def sname(s):
    if s not in stream_names:
        stream_names[s] = len(stream_names)
    return stream_names[s]
trace = []
for t in snap['device_traces'][device]:
    t = dict(t)
    t['stream'] = sname(t['stream'])
    if t['action'] == 'free_completed' and trace:
        prev = trace[-1]
        if prev['action'] == 'free_requested' and prev['addr'] == t['addr']:
            prev['action'] = 'free'
            continue
    trace.append(t)
segs0 = []
blocks0 = {}
for seg in snap['segments']:
    if seg['device'] != device:
        continue
    segs0.append({'addr': seg['address'], 'size': seg['total_size'], 'stream': sname(seg['stream'])})
    addr = seg['address']
    for b in seg['blocks']:
        if b['state'] in ('active_allocated', 'active_pending_free'):
            blocks0[addr] = {'addr': addr, 'size': b['size'], 'req': b['requested_size'],
                             'pending': b['state'] == 'active_pending_free'}
        addr += b['size']
segs0.sort(key=lambda s: s['addr'])

# --- simulate_memory, incrementally backwards; draw() needs every block in a segment ---
segs = [dict(s) for s in segs0]
blocks = dict(blocks0)

def find_index(pred):
    for i, s in enumerate(segs):
        if pred(s):
            return i
    return -1

def map_segment(merge, seg, i):
    idx = find_index(lambda e: e['addr'] > seg['addr'])
    if not merge:
        if idx == -1:  # JS splice(-1, 0, x) inserts before the last element
            idx = len(segs) - 1 if segs else 0
        segs.insert(idx, seg)
        return
    if idx == -1:
        idx = len(segs)
    segs.insert(idx, seg)
    if idx + 1 < len(segs):
        nxt = segs[idx + 1]
        if seg['addr'] + seg['size'] == nxt['addr'] and seg['stream'] == nxt['stream']:
            seg['size'] += nxt['size']; del segs[idx + 1]
    if idx > 0:
        prev = segs[idx - 1]
        if prev['addr'] + prev['size'] == seg['addr'] and prev['stream'] == seg['stream']:
            prev['size'] += seg['size']; del segs[idx]

def unmap_segment(merge, seg, i):
    if not merge:
        idx = find_index(lambda x: x['addr'] == seg['addr'])
        if idx == -1:
            fail(f'event {i} segment_alloc {seg["addr"]:#x}: no segment at that address; JS splice(-1,1) drops the LAST segment instead')
        if segs[idx]['size'] != seg['size']:
            fail(f'event {i} segment_alloc {seg["addr"]:#x}: segment there has size {segs[idx]["size"]}, event {seg["size"]}')
        del segs[idx]
        return
    end = seg['addr'] + seg['size']
    idx = find_index(lambda e: e['addr'] <= seg['addr'] and end <= e['addr'] + e['size'])
    if idx == -1:
        fail(f'event {i} segment_map {seg["addr"]:#x}+{seg["size"]:#x} (stream {seg["stream"]}): no segment contains it -> TypeError in unmap_segment; segs near: ' +
             str([(hex(s['addr']), hex(s['size']), s['stream']) for s in segs if s['addr'] < end + (64<<20) and s['addr'] + s['size'] > seg['addr'] - (64<<20)]))
    ex = segs[idx]
    ex_end = ex['addr'] + ex['size']
    if ex['addr'] == seg['addr']:
        ex['addr'] += seg['size']; ex['size'] -= seg['size']
        if ex['size'] == 0:
            del segs[idx]
    elif ex_end == end:
        ex['size'] -= seg['size']
    else:
        ex['size'] = seg['addr'] - ex['addr']
        segs.insert(idx + 1, {'addr': end, 'size': ex_end - end, 'stream': ex['stream']})

def check_draw(step):
    sb = sorted(segs, key=lambda s: s['addr'])
    import bisect
    starts = [s['addr'] for s in sb]
    for a, b in blocks.items():
        k = bisect.bisect_right(starts, a) - 1
        if k < 0 or a >= sb[k]['addr'] + sb[k]['size']:
            fail(f'draw({step}): block {a:#x} ({b["size"]} B) is in no segment -> TypeError (b.segment null)')
        if a + b['req'] > sb[k]['addr'] + sb[k]['size']:
            fail(f'draw({step}): block {a:#x} ({b["req"]} B requested) runs past its segment end '
                 f'[{sb[k]["addr"]:#x}, +{sb[k]["size"]:#x}) stream {sb[k]["stream"]}; events {step+1}..: '
                 + '; '.join(f'{j}:{trace[j]["action"]} {trace[j]["addr"]:#x}+{trace[j]["size"]:#x} s{trace[j]["stream"]}' for j in range(max(0, step - 3), min(len(trace), step + 4))))

check_draw(len(trace) - 1)
for i in range(len(trace) - 1, 0, -1):
    e = trace[i]
    act = e['action']
    if act == 'free':
        blocks[e['addr']] = {'addr': e['addr'], 'size': e['size'], 'req': e['size'], 'pending': False}
    elif act == 'free_requested':
        if e['addr'] not in blocks:
            fail(f'event {i} free_requested {e["addr"]:#x}: no block (l_block_map[addr] undefined -> TypeError)')
        blocks[e['addr']]['pending'] = False
    elif act == 'free_completed':
        blocks[e['addr']] = {'addr': e['addr'], 'size': e['size'], 'req': e['size'], 'pending': True}
    elif act == 'alloc':
        blocks.pop(e['addr'], None)
    elif act in ('segment_free', 'segment_unmap'):
        map_segment(act == 'segment_unmap', {'addr': e['addr'], 'size': e['size'], 'stream': e['stream']}, i)
    elif act in ('segment_alloc', 'segment_map'):
        unmap_segment(act == 'segment_map', {'addr': e['addr'], 'size': e['size'], 'stream': e['stream']}, i)
    check_draw(i - 1)
print(f'ok: {len(snap["segments"])} segments, {len(trace)} viz events')

#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz/fuzz_weight_files.cpp: the data.pkl of state_dicts that
Python's torch.save writes (and of a TorchScript archive), and whole files, each prefixed by the
byte that tells the fuzz target how to read it (0: a torch.save state_dict's pickle; 1: a
TorchScript archive's pickle; 2: a whole torch.save file; 3: a whole TorchScript archive; with a
torch that has torch.export, 4: a whole PT2 archive of torch.export.save, 5: its program's JSON,
6: its weights config; with the safetensors package, 8: a whole .safetensors file; with torch 2.x's
torch.distributed.checkpoint, 9: a DCP .metadata, 10: a tensor item of a .distcp file; 11: a copy of
a neighbour's shares as elastic training leaves it in /dev/shm).

    scripts/make-fuzz-corpus.py tests/fuzz/corpus     # with the python3 of the libtorch in use

Also writes the two largest real cases that serialization/pickle/pickle_limits.hpp's limits are stated
against (resnet152's state_dict and Llama-2-7B's layout) as resnet152.pkl and llama7b.pkl into
the directory given as a second argument, if any.
"""
import collections, io, os, sys, zipfile

import torch
import torch.nn as nn


def saved(obj, save=torch.save, **kwargs):
    buffer = io.BytesIO()
    save(obj, buffer, **kwargs)
    return buffer.getvalue()


def without_methods(archive_bytes):
    """A TorchScript archive with every method cut from its code and no debug tables: the layout
    of a trainloop checkpoint (class declarations only), which the check lets torch::jit::load read."""
    source = zipfile.ZipFile(io.BytesIO(archive_bytes))
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w', zipfile.ZIP_STORED) as target:
        for name in source.namelist():
            data = source.read(name)
            if name.endswith('.debug_pkl'):
                continue
            if '/code/' in name and name.endswith('.py'):
                kept, skipping = [], False
                for line in data.decode().splitlines():
                    if line.startswith('class '):
                        skipping = False
                    elif line.lstrip().startswith('def '):
                        skipping = True
                    if not skipping:
                        kept.append(line)
                data = ('\n'.join(kept) + '\n').encode()
            target.writestr(name, data)
    return out.getvalue()


def data_pkl(obj, save=torch.save, **kwargs):
    buffer = io.BytesIO()
    save(obj, buffer, **kwargs)
    archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    return archive.read(next(n for n in archive.namelist() if n.endswith('/data.pkl')))


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def llama7b_layout():
    state = collections.OrderedDict()
    one = torch.zeros(1)
    def t(*shape):
        return one.expand(*shape)
    state['model.embed_tokens.weight'] = t(32000, 4096)
    for i in range(32):
        p = f'model.layers.{i}.'
        for n in ['q_proj', 'k_proj', 'v_proj', 'o_proj']:
            state[p + 'self_attn.' + n + '.weight'] = t(4096, 4096)
        state[p + 'self_attn.rotary_emb.inv_freq'] = t(64)
        for n, s in [('gate_proj', (11008, 4096)), ('up_proj', (11008, 4096)), ('down_proj', (4096, 11008))]:
            state[p + 'mlp.' + n + '.weight'] = t(*s)
        state[p + 'input_layernorm.weight'] = t(4096)
        state[p + 'post_attention_layernorm.weight'] = t(4096)
    state['model.norm.weight'] = t(4096)
    state['lm_head.weight'] = t(32000, 4096)
    return state


def export_seeds(small):
    """A torch.export.save archive of `small` (train mode, dynamic batch: its BatchNorm updates
    buffers in place), and its program's JSON and weights config on their own."""
    if not hasattr(torch, 'export') or not hasattr(torch.export, 'save'):
        return {}
    example = torch.randn(4, 3, 5, 5)
    program = torch.export.export(small.train(), (example,), dynamic_shapes=({0: torch.export.Dim('batch')},))
    archive = saved(program, save=torch.export.save)
    records = zipfile.ZipFile(io.BytesIO(archive))
    def record(suffix):
        return next(records.read(name) for name in records.namelist() if name.endswith(suffix))
    return {'pt2_file': (4, archive), 'pt2_program': (5, record('models/model.json')),
            'pt2_weights_config': (6, record('data/weights/model_weights_config.json'))}


def safetensors_seeds(small, dtypes):
    """Whole .safetensors files, as safetensors.torch.save_file writes them: the small model's
    state_dict (with __metadata__) and one tensor of every dtype (a scalar, an empty one)."""
    try:
        from safetensors.torch import save as save_safetensors
    except ImportError:
        return {}
    every = {name: tensor.contiguous() for name, tensor in dtypes.items() if name not in ('slice', 't')}
    every.update({name: torch.ones(3, dtype=dtype) for name, dtype in
                  (('f8_e4m3', getattr(torch, 'float8_e4m3fn', None)), ('f8_e5m2', getattr(torch, 'float8_e5m2', None)))
                  if dtype is not None})
    return {'safetensors_small': (8, save_safetensors(small.state_dict(), metadata={'format': 'pt'})),
            'safetensors_dtypes': (8, save_safetensors(every))}


def dcp_seeds():
    """A torch.distributed.checkpoint directory's .metadata (pickle.dump's default protocol and
    protocol 2) and tensor items of its __0_0.distcp (torch.save blobs: float32 [2, 3], the
    fixed entry the fuzz target reads them as; a transposed view; a bfloat16 one)."""
    try:
        import pickle, tempfile
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError:
        return {}
    if not hasattr(dcp, 'FileSystemReader') or not torch.__version__.startswith('2.'):
        return {}
    import warnings
    warnings.filterwarnings('ignore')
    with tempfile.TemporaryDirectory() as directory:
        state = {'model': {'w': torch.arange(6.).reshape(2, 3), 't': torch.arange(6.).reshape(3, 2).t(),
                           'b': torch.ones(5, dtype=torch.bfloat16)},
                 'optim': {'state': {'w': {'step': torch.tensor(3.)}}, 'param_groups': [{'lr': 0.1, 'params': ['w']}]}}
        dcp.save(state, checkpoint_id=directory)
        metadata_bytes = open(os.path.join(directory, '.metadata'), 'rb').read()
        metadata = FileSystemReader(directory).read_metadata()
        data = open(os.path.join(directory, '__0_0.distcp'), 'rb').read()
        def item(fqn):
            info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
            return data[info.offset:info.offset + info.length]
        metadata.storage_meta = None
        return {'dcp_metadata': (9, metadata_bytes), 'dcp_metadata_p2': (9, pickle.dumps(metadata, protocol=2)),
                'dcp_item': (10, item('model.w')), 'dcp_item_transposed': (10, item('model.t')),
                'dcp_item_bf16': (10, item('model.b'))}


def shared_copy_seeds():
    """Copies of a neighbour's shares as elastic training leaves them in /dev/shm
    (include/trainloop/distributed/elastic/shared_copy_file.hpp): the block of boxes, their
    descriptor (box_descriptor.hpp: int64 numbers, then the keys), then the trailer (descriptor
    length, block length, step 7, the mark). Written here byte by byte: no Python tool writes them."""
    import struct
    float32, float64, bfloat16 = 6, 7, 15  # c10::ScalarType

    def copy_file(boxes, step=7):
        block, numbers, keys = b'', [0x736f7870, len(boxes)], b''
        for key, dtype, offsets, size, sizes, data in boxes:
            numbers += [dtype, len(size)] + offsets + size + sizes + [len(block), len(key)]
            block += data
            keys += key.encode()
        descriptor = struct.pack(f'<{len(numbers)}q', *numbers) + keys
        return block + descriptor + struct.pack('<4q', len(descriptor), len(block), step, 0x79706f6365726873)

    two = copy_file([('model.w', float32, [1, 0], [3, 4], [2, 4], struct.pack('<8f', *range(8))),
                     ('optim.state.w.step', float64, [], [], [], struct.pack('<d', 7.0))])
    mixed = copy_file([('model.b', bfloat16, [2], [6], [4], bytes(8)),
                       ('model.e', float32, [0, 0], [0, 3], [0, 3], b'')])
    return {'shared_copy': (11, two), 'shared_copy_bf16_empty': (11, mixed)}


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    small = Small()
    base = torch.arange(30, dtype=torch.float64).reshape(6, 5)
    dtypes = collections.OrderedDict(
        [('base', base), ('slice', base[1:4, ::2]), ('t', base.t()), ('half', torch.ones(3, dtype=torch.half)),
         ('bf16', torch.ones(2, 2, dtype=torch.bfloat16)), ('i8', torch.arange(4, dtype=torch.int8)),
         ('bool', torch.tensor([True, False])), ('scalar', torch.tensor(7)), ('empty', torch.zeros(0, 3)),
         ('big', torch.tensor([2**40 + 3, -2**35]))])
    seeds = {
        'small_p2': (0, data_pkl(small.state_dict())),
        'small_p4': (0, data_pkl(small.state_dict(), pickle_protocol=4)),
        'dtypes': (0, data_pkl(dtypes)),
        'parameters': (0, data_pkl(collections.OrderedDict(small.named_parameters()))),
        'scripted': (1, data_pkl(torch.jit.script(small), save=torch.jit.save)),
        # A legal view of 2^40 elements over one float (stride 0): read, and the target must not
        # materialize it (its first touch() allocated 8 TiB here).
        'stride0_2e40': (0, data_pkl({'expanded': torch.zeros(1).expand(2**40)})),
        # Whole files (the zip directory and the archive's records): a state_dict, and a
        # TorchScript archive without methods (the checkpoint path, through torch::jit::load).
        'file_state_dict': (2, saved(small.state_dict())),
        'file_no_methods': (3, without_methods(saved(torch.jit.script(small), save=torch.jit.save))),
    }
    seeds.update(export_seeds(small))
    seeds.update(safetensors_seeds(small, dtypes))
    seeds.update(dcp_seeds())
    seeds.update(shared_copy_seeds())
    for name, (flavor, pickle) in seeds.items():
        with open(os.path.join(out, name), 'wb') as f:
            f.write(bytes([flavor]) + pickle)
    if len(sys.argv) > 2:
        import torchvision
        real = sys.argv[2]
        os.makedirs(real, exist_ok=True)
        for name, state in [('resnet152', torchvision.models.resnet152().state_dict()), ('llama7b', llama7b_layout())]:
            with open(os.path.join(real, name + '.pkl'), 'wb') as f:
                f.write(data_pkl(state))
    print(f'make-fuzz-corpus.py: {len(seeds)} seeds in {out} (torch {torch.__version__})')


if __name__ == '__main__':
    main()

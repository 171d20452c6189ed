# Derives the operators torch.export's training IR emits for real models: the positive allow-list
# of include/trainloop/interpreter/operator_policy.hpp is this script's output (issue 50).
#
#   python scripts/derive-operator-allowlist.py [--json OUT]     # this torch's exports, printed (and as JSON)
#   python scripts/derive-operator-allowlist.py --header OUT.hpp A.json B.json ...
#                                    # the union of several runs (one per supported torch release)
#                                    # written as include/trainloop/interpreter/exported_operators.hpp
#
# Exports, in train and in eval mode, with a dynamic batch (as tests/export_reference.py does):
# timm's four families (resnet18, efficientnet_b0, convnext_atto, vit_tiny_patch16_224),
# torchvision's classifiers (resnet18, mobilenet_v3_small, efficientnet_b0, convnext_tiny,
# densenet121, squeezenet1_1, shufflenet_v2_x0_5, regnet_y_400mf, vgg11_bn, swin_t, vit_b_16,
# maxvit_t), trainloop's zoo as Python spells it (torchvision's resnet and a fastai-style xresnet
# stem), and transformer blocks (nn.TransformerEncoderLayer, a decoder layer, nn.MultiheadAttention,
# an embedding + LayerNorm + GELU MLP). Prints each operator.overload with the models that use it.
import argparse, collections, json, sys
import torch, torch.nn as nn

def targets(model, x):
    found = set()
    for train in (True, False):
        model.train(train)
        batch = torch.export.Dim('batch', min=2, max=1024)
        program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
        for node in program.graph.nodes:
            if node.op == 'call_function':
                found.add(str(node.target))
    return found

class Tokens(nn.Module):  # embedding + positional add + LayerNorm + GELU MLP + head: a small LM block
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.pos = nn.Parameter(torch.zeros(1, 16, 32))
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, activation='gelu', norm_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
        self.head = nn.Linear(32, 100)
    def forward(self, ids):
        h = self.embed(ids) + self.pos
        return self.head(self.mlp(self.block(h))).mean(1)

class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        y = self.layer(x, x, tgt_mask=mask, tgt_is_causal=True)
        return self.attention(y, y, y, need_weights=False)[0]

class XResNetStem(nn.Module):  # fastai's xresnet stem and a block: conv-bn-relu x3, maxpool, avgpool shortcut
    def __init__(self):
        super().__init__()
        def cbr(i, o, s): return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.stem = nn.Sequential(cbr(3, 16, 2), cbr(16, 16, 1), cbr(16, 32, 1), nn.MaxPool2d(3, 2, 1))
        self.idpath = nn.Sequential(nn.AvgPool2d(2, ceil_mode=True), nn.Conv2d(32, 64, 1, bias=False), nn.BatchNorm2d(64))
        self.body = nn.Sequential(cbr(32, 64, 2), nn.Conv2d(64, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(64, 10))
    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.relu(self.body(x) + self.idpath(x)))

def models():
    import timm, torchvision.models as tv
    for name in ('resnet18', 'efficientnet_b0', 'convnext_atto', 'vit_tiny_patch16_224'):
        kw = dict(num_classes=10)
        if name.startswith('vit'):
            kw.update(img_size=32)
        yield 'timm.' + name, timm.create_model(name, **kw), torch.randn(2, 3, 32, 32)
    for name, size in (('resnet18', 32), ('mobilenet_v3_small', 32), ('efficientnet_b0', 32), ('convnext_tiny', 32),
                       ('densenet121', 32), ('squeezenet1_1', 64), ('shufflenet_v2_x0_5', 32), ('regnet_y_400mf', 32),
                       ('vgg11_bn', 32), ('swin_t', 64), ('vit_b_16', 224), ('maxvit_t', 224)):
        yield 'torchvision.' + name, getattr(tv, name)(num_classes=10), torch.randn(2, 3, size, size)
    yield 'zoo.xresnet_stem', XResNetStem(), torch.randn(2, 3, 32, 32)
    yield 'transformer.tokens', Tokens(), torch.randint(0, 100, (2, 16))
    yield 'transformer.decoder', Decoder(), torch.randn(2, 8, 32)

def write_header(out, runs):
    users = collections.defaultdict(set)
    versions = []
    for path in runs:
        with open(path) as f:
            run = json.load(f)
        versions.append(run.get('torch', path))
        for target, models in run.get('operators', run).items():
            users[target].update(models)
    qualified = {}
    for target in users:  # "aten.conv2d.default" -> "aten::conv2d.default"
        # Python's operator.getitem / operator.mul on symbolic ints and aten.sym_size are evaluated
        # by trainloop itself (symbolic_ints.hpp), not called through the dispatcher.
        if not target.startswith(('aten.', 'prims.')) or target.startswith('aten.sym_'):
            continue
        space, rest = target.split('.', 1)
        qualified[space + '::' + rest] = users[target]
    lines = [f'      "{name}",  // {len(qualified[name])}: {", ".join(sorted(qualified[name])[:3])}{" ..." if len(qualified[name]) > 3 else ""}'
             for name in sorted(qualified)]
    with open(out, 'w') as f:
        f.write(f"""#pragma once
/// @file
/// @brief The operators a program from a file may run (operator_policy.hpp says why a list):
/// every operator.overload torch.export's training IR emitted, in train and in eval mode, for the
/// models scripts/derive-operator-allowlist.py exports, under torch {', '.join(versions)}.
/// Generated by that script (`--header`); do not edit by hand: rerun it. Each line says how many of
/// the exported models use the operator, and a few of them.

#include <set>
#include <string>

namespace trainloop::serialization {{

/// @brief The derived list ({len(qualified)} operators), as "namespace::name.overload".
inline const std::set<std::string>& exported_operators() {{
  static const std::set<std::string> operators = {{
{chr(10).join(lines)}
  }};
  return operators;
}}

}}  // namespace trainloop::serialization
""")
    print(f'{len(qualified)} operators from {len(runs)} runs ({", ".join(versions)}) written to {out}')

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--json')
    parser.add_argument('--header', nargs='+', metavar=('OUT', 'RUN'))
    args = parser.parse_args()
    if args.header:
        return write_header(args.header[0], args.header[1:])
    torch.manual_seed(0)
    users = collections.defaultdict(list)
    for name, model, x in models():
        try:
            for target in targets(model, x):
                users[target].append(name)
            print('exported', name, file=sys.stderr, flush=True)
        except Exception as error:  # say so; the list is what the others use
            print('not exported', name, type(error).__name__, str(error)[:200], file=sys.stderr, flush=True)
    for target in sorted(users):
        print(f'{target:60s} {len(users[target]):3d}  {", ".join(users[target][:4])}{" ..." if len(users[target]) > 4 else ""}')
    if args.json:
        with open(args.json, 'w') as out:
            json.dump({'torch': torch.__version__.split('+')[0], 'operators': {k: users[k] for k in sorted(users)}}, out, indent=1)

if __name__ == '__main__':
    main()

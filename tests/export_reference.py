# The Python side of test_exported_program: timm models exported by torch.export, and the same
# steps trained in Python eager as references for export_worker's (C++) runs.
#
#   export_reference.py generate OUT STEPS MODEL...  OUT/MODEL.pt2, MODEL_data.pt, and per optimizer
#                                                    (sgd, adamw, torch_adamw) and mode (single, ddp):
#                                                    MODEL_OPT_MODE.pt (state_dict after STEPS steps) and
#                                                    MODEL_OPT_MODE_logits.pt (eval-mode logits of xe)
#   export_reference.py check_back OUT MODEL CPP_DIR  C++'s state.pt into timm's model (strict), and
#                                                    its trained.pt2 through torch.export.load
#
# Random init (no hub download), timm's default drop rates (0: no dropout or drop-path), one thread.
import sys, os, copy, collections, math
import torch, torch.nn as nn, timm
torch.set_num_threads(1)
command, out = sys.argv[1], sys.argv[2]
STEPS, BATCH = int(sys.argv[3]) if command == 'generate' else 0, 8

def make(name):
    torch.manual_seed(0)
    kw = dict(num_classes=10)  # random init, no hub download; drop rates stay timm's default 0
    if name.startswith('vit'):
        kw.update(img_size=32)
    return timm.create_model(name, **kw).train()

class AdamWAsLibtorch(torch.optim.AdamW):
    """torch.optim.AdamW with libtorch's rounding: exp_avg.mul_(beta1).add_(grad, 1 - beta1) where
    Python's lerp_s (torch/csrc/api/src/optim/adamw.cpp); the same algorithm otherwise."""
    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                p.mul_(1 - group['lr'] * group['weight_decay'])
                state['step'] += 1
                correction1, correction2 = 1 - beta1 ** state['step'], 1 - beta2 ** state['step']
                state['exp_avg'].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state['exp_avg_sq'].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state['exp_avg_sq'].sqrt() / math.sqrt(correction2)).add_(group['eps'])
                p.addcdiv_(state['exp_avg'], denom, value=-group['lr'] / correction1)

def optimizer(kind, params):
    if kind == 'sgd':
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if kind == 'adamw':
        return AdamWAsLibtorch(params, lr=1e-3, weight_decay=0.05)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)  # 'torch_adamw': Python's own rounding

def save(name, **tensors):
    torch.save(collections.OrderedDict(tensors), os.path.join(out, name))

def train_single(model, kind, x, y):
    opt = optimizer(kind, model.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[k * BATCH:(k + 1) * BATCH]), y[k * BATCH:(k + 1) * BATCH]).backward()
        opt.step()
    return model

def train_ddp(model, kind, x, y):  # two ranks of BATCH/2 each: rank r gets samples r, r+2, ...
    ranks = [model, copy.deepcopy(model)]
    opts = [optimizer(kind, m.parameters()) for m in ranks]
    half = BATCH // 2
    for k in range(STEPS):
        for r, m in enumerate(ranks):
            opts[r].zero_grad()
            xs, ys = x[r::2][k * half:(k + 1) * half], y[r::2][k * half:(k + 1) * half]
            nn.functional.cross_entropy(m(xs), ys).backward()
        for p0, p1 in zip(ranks[0].parameters(), ranks[1].parameters()):
            mean = (p0.grad + p1.grad) / 2
            p0.grad.copy_(mean); p1.grad.copy_(mean)
        for o in opts:
            o.step()
    return ranks[0]

if command == 'generate':
    for name in sys.argv[4:]:
        model = make(name)
        torch.manual_seed(1)
        x, y, xe = torch.randn(STEPS * BATCH, 3, 32, 32), torch.randint(0, 10, (STEPS * BATCH,)), torch.randn(5, 3, 32, 32)
        save(name + '_data.pt', x=x, y=y, xe=xe)
        batch = torch.export.Dim('batch', min=1, max=1024)
        program = torch.export.export(model, (x[:BATCH],), dynamic_shapes=({0: batch},))
        torch.export.save(program, os.path.join(out, name + '.pt2'))
        for kind in ('sgd', 'adamw', 'torch_adamw'):
            for mode, train in (('single', train_single), ('ddp', train_ddp))[:1 if kind == 'torch_adamw' else 2]:
                trained = train(copy.deepcopy(model), kind, x, y)
                torch.save(trained.state_dict(), os.path.join(out, f'{name}_{kind}_{mode}.pt'))
                with torch.no_grad():
                    save(f'{name}_{kind}_{mode}_logits.pt', logits=trained.eval()(xe))
        print('generated', name, flush=True)
elif command == 'check_back':  # argv[3]: the model, [4]: the directory of C++'s state.pt and trained.pt2
    name, cpp = sys.argv[3], sys.argv[4]
    state = torch.load(os.path.join(cpp, 'state.pt'), weights_only=True)
    model = make(name)
    model.load_state_dict(state, strict=True)
    program = torch.export.load(os.path.join(cpp, 'trained.pt2'))
    in_program = max((program.state_dict[k].double() - state[k].double()).abs().max().item() for k in state)
    xe = torch.load(os.path.join(out, name + '_data.pt'), weights_only=True)['xe']
    with torch.no_grad():
        eager = model.train()(xe)  # train mode: the program as exported
        exported = program.module()(xe)
    print(f'strict_load=ok program_vs_state={in_program:.6g} program_vs_eager={(exported - eager).abs().max().item():.6g}')

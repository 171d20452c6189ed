#!/usr/bin/env bash
# examples/image_classifier against Python, end to end: a resnet18 trained in Python and loaded
# with --pretrained (a state_dict) or --scripted (TorchScript), or a timm model exported with
# torch.export (--exported, where Python has timm), evaluated with --epochs 0, scores
# what Python scored on the same images; a model trained here and written with --export scores in
# Python what it scored here; bad input is a clear error. Skipped without a python3 that imports
# torch and torchvision (scripts/install-deps.sh installs Debian's).
#
#   tests/example_image_classifier.sh <image_classifier executable> <scratch dir>
set -euo pipefail
example=$1
work=$2
python=""
for candidate in ${TRAINLOOP_PYTHON:-python3 /usr/bin/python3}; do
  if "$candidate" -c 'import torch, torchvision' > /dev/null 2>&1; then python=$candidate; break; fi
done
if [[ -z "$python" ]]; then
  echo "TRAINLOOP_TEST_SKIPPED: no python3 imports torch and torchvision (set TRAINLOOP_PYTHON)"
  exit 0
fi
rm -rf "$work"
mkdir -p "$work"

cat > "$work/reference.py" <<'PY'
import sys, os, torch, torchvision
from torchvision import transforms
torch.set_num_threads(2)
command, work = sys.argv[1], sys.argv[2]
normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
def folder(split):
    return torchvision.datasets.ImageFolder(os.path.join(work, 'images', split), normalize)
def evaluate(model):  # the mean loss per image and the accuracy over the test folder
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(folder('test'), batch_size=64):
            out = model(x)
            loss += torch.nn.functional.cross_entropy(out, y, reduction='sum').item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    print(f'python: test accuracy {correct / n:.6f} (loss {loss / n:.6f}, {n} test images)')
if command == 'generate':  # 4 classes of 32 x 32 RGB images: a colour and a stripe direction, with noise
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for split, count in (('train', 48), ('test', 24)):
        for c in range(4):
            os.makedirs(os.path.join(work, 'images', split, f'class{c}'))
            for i in range(count):
                stripes = (torch.arange(32) // 4 % 2).float()
                pattern = stripes.view(1, 32).expand(32, 32) if c % 2 else stripes.view(32, 1).expand(32, 32)
                colour = torch.tensor([[1.0, 0.3, 0.2], [0.2, 0.4, 1.0]][c // 2]).view(3, 1, 1)
                image = 0.6 * colour * pattern + 0.4 * torch.rand(3, 32, 32, generator=g)
                pixels = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
                Image.fromarray(pixels).save(os.path.join(work, 'images', split, f'class{c}', f'{i:03d}.png'))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for x, y in torch.utils.data.DataLoader(folder('train'), batch_size=48, shuffle=True):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    torch.save(model.state_dict(), os.path.join(work, 'resnet18_state.pt'))
    torch.jit.script(model).save(os.path.join(work, 'resnet18_scripted.pt'))
    evaluate(model)
elif command == 'state_dict':
    model = torchvision.models.resnet18(num_classes=4)
    model.load_state_dict(torch.load(sys.argv[3]))
    evaluate(model)
elif command == 'scripted':
    evaluate(torch.jit.load(sys.argv[3]))
elif command == 'exported':  # a .pt2's weights in the timm model it was exported from (strict)
    import timm
    model = timm.create_model('resnet18', num_classes=4)
    model.load_state_dict(torch.export.load(sys.argv[3]).state_dict, strict=True)
    evaluate(model)
PY

accuracy_of() { grep -ao "test accuracy [0-9.e-]*" <<< "$1" | awk '{print $3}'; }
loss_of() { grep -ao "(loss [0-9.e+-]*" <<< "$1" | sed 's/,//' | awk '{print $2}'; }
# Two results agree: the same accuracy (a fraction of 96 images) and losses within 1e-4.
check_same() {
  local what=$1 ours=$2 theirs=$3
  echo "$what"; echo "  C++:    $ours"; echo "  Python: $theirs"
  "$python" - "$(accuracy_of "$ours")" "$(accuracy_of "$theirs")" "$(loss_of "$ours")" "$(loss_of "$theirs")" <<'PY' || { echo "FAIL: $what" >&2; exit 1; }
import sys
a, b, la, lb = map(float, sys.argv[1:])
sys.exit(0 if abs(a - b) < 1e-5 and abs(la - lb) <= 1e-4 else 1)
PY
}
common=(--data "$work/images" --size 32 --arch resnet18 --workers 0 --batch-size 32)

python_result=$("$python" "$work/reference.py" generate "$work")
check_same "a Python-trained state_dict, --pretrained --epochs 0" \
  "$("$example" "${common[@]}" --pretrained "$work/resnet18_state.pt" --epochs 0)" "$python_result"
check_same "a Python-trained TorchScript model, --scripted --epochs 0" \
  "$("$example" "${common[@]}" --scripted "$work/resnet18_scripted.pt" --epochs 0)" "$python_result"

ours=$("$example" "${common[@]}" --pretrained "$work/resnet18_state.pt" --epochs 1 --export "$work/cpp_state.pt")
check_same "trained here, --export as a state_dict, evaluated in Python" \
  "$ours" "$("$python" "$work/reference.py" state_dict "$work" "$work/cpp_state.pt")"
ours=$("$example" "${common[@]}" --scripted "$work/resnet18_scripted.pt" --epochs 1 --export "$work/cpp_scripted.pt")
check_same "trained here, --scripted --export as TorchScript, evaluated in Python" \
  "$ours" "$("$python" "$work/reference.py" scripted "$work" "$work/cpp_scripted.pt")"

# A timm model exported by torch.export (examples/export_timm_model.py), where Python has both.
if "$python" -c 'import torch, timm; torch.export.save' > /dev/null 2>&1; then
  "$python" "$(dirname "$0")/../examples/export_timm_model.py" resnet18 --classes 4 --size 32 --out "$work/timm.pt2"
  check_same "a timm model exported by torch.export, --exported --epochs 0" \
    "$("$example" "${common[@]}" --exported "$work/timm.pt2" --epochs 0)" \
    "$("$python" "$work/reference.py" exported "$work" "$work/timm.pt2")"
  ours=$("$example" "${common[@]}" --exported "$work/timm.pt2" --epochs 1 --export "$work/cpp_timm.pt2")
  check_same "trained here, --exported --export as a .pt2, its weights in timm's model in Python" \
    "$ours" "$("$python" "$work/reference.py" exported "$work" "$work/cpp_timm.pt2")"
else
  echo "skipped the --exported cases: $python has no torch.export or timm"
fi

# Bad input: a clear error and a non-zero exit.
expect_error() {
  local what=$1 pattern=$2; shift 2
  local output status=0
  output=$("$example" "$@" 2>&1) || status=$?
  if [[ $status -eq 0 ]] || ! grep -q -- "$pattern" <<< "$output"; then
    echo "FAIL: $what: exit $status, expected an error matching '$pattern':" >&2
    echo "$output" >&2
    exit 1
  fi
  echo "$what: $(grep -- "$pattern" <<< "$output" | head -n 1)"
}
data=(--data "$work/images" --size 32 --workers 0 --epochs 0)
expect_error "an unknown architecture" 'architecture is "resnet19"; expected one of resnet18' "${data[@]}" --arch resnet19
expect_error "a state_dict of another architecture" "does not fit the model: 134 missing (0.0.weight" "${data[@]}" --arch xresnet18 --pretrained "$work/resnet18_state.pt"
expect_error "a state_dict given as TorchScript" "not a TorchScript model" "${data[@]}" --scripted "$work/resnet18_state.pt"
expect_error "a state_dict given as a torch.export program" "not a PT2 archive" "${data[@]}" --exported "$work/resnet18_state.pt"
echo "PASS"

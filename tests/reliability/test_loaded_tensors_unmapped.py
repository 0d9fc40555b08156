"""Issue 25: no tensor we load stays a view of the file's pages. safetensors' get_tensor maps the file, so
a tensor that outlived the load (kept by an optimizer, returned in a state dict, held by the frames of a
CheckpointError's traceback, which pytest formats) turned a later rewrite of the file in place into a
SIGBUS that killed the whole process with no Python error (1 run in 3 of the suite died so). Each way of
loading runs in a child process: it loads, truncates the file in place, then reads every byte of every
tensor the process holds and every tensor reachable from the error's traceback. A mapped one is a
SIGBUS, which only kills the child."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import gc, os, sys, types
    import torch
    import mirrored as mr
    from mirrored.training import checkpoint
    from mirrored.training.checkpoint import CheckpointError

    def touch(tensors):
        """Reads every byte of each tensor's storage (a page of a truncated file mapping: SIGBUS)."""
        for t in tensors:
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            if storage.nbytes():
                torch.empty(0, dtype=torch.uint8).set_(storage).sum()

    def touch_everything_kept():
        gc.collect()
        touch([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])

    def reachable(value, found, seen, depth=0):
        """The tensors reachable from `value` through containers and objects' attributes."""
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for k, v in list(value.items()):
                reachable(k, found, seen, depth + 1)
                reachable(v, found, seen, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in list(value):
                reachable(v, found, seen, depth + 1)
        elif not isinstance(value, (type, types.ModuleType, types.FunctionType, str, bytes)) and hasattr(
                value, "__dict__"):
            reachable(vars(value), found, seen, depth + 1)

    def touch_traceback(error):
        """Every tensor in the locals of every frame of `error`'s traceback (and of its causes)."""
        found, seen = [], set()
        while error is not None:
            tb = error.__traceback__
            while tb is not None:
                reachable(dict(tb.tb_frame.f_locals), found, seen)
                tb = tb.tb_next
            error = error.__cause__ or error.__context__
        touch(found)
        return len(found)

    def mlp(width=8):
        torch.manual_seed(0)
        with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
            model = mr.Model(torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)))
            model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def data():
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        return mr.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def trained(width=8):
        model = mlp(width)
        model.fit(data(), epochs=1, verbose=0)  # momentum buffers: optimizer state to load
        return model

    def saved(name, width=8):
        path = os.path.join(DIR, name + ".safetensors")
        trained(width).save(path)
        return path

    def backup(name, width=8):
        directory = os.path.join(DIR, name)
        mlp(width).fit(data(), epochs=1, verbose=0, callbacks=[
            mr.callbacks.BackupAndRestore(directory, delete_checkpoint=False)])
        path = os.path.join(directory, "training_state.safetensors")
        os.link(path, path + ".read")  # the file the restore reads, even once a new backup replaces it
        return directory, path + ".read"

    def refused(load):
        try:
            load()
        except CheckpointError as e:
            return e
        raise AssertionError("the load was not refused")

    def run(case):
        kept = []
        if case == "load_checkpoint":
            path = saved(case)
            kept.append(checkpoint.load_checkpoint(path))
        elif case == "load_state_dict":
            path = saved(case)
            kept.append(checkpoint.load_state_dict(path))
        elif case == "Model.load":
            path = saved(case)
            kept.append(mr.Model.load(path, module=mlp().module))
        elif case == "Model.load_weights":
            path = saved(case)
            model = mlp()
            model.load_weights(path)
            kept.append(model)
        elif case in ("Checkpoint.restore", "Checkpoint.read"):
            path = os.path.join(DIR, case)
            mr.train.Checkpoint(model=trained()).write(path)
            ckpt = mr.train.Checkpoint(model=mlp())
            kept.append((ckpt, getattr(ckpt, case.split(".")[1])(path)))
        elif case == "BackupAndRestore":
            directory, path = backup(case)
            model = mlp()
            model.fit(data(), epochs=2, verbose=0, callbacks=[
                mr.callbacks.BackupAndRestore(directory, delete_checkpoint=False)])
            kept.append(model)
        elif case == "refused Model.load":
            path = saved(case)
            error = refused(lambda: mr.Model.load(path, module=torch.nn.Sequential(
                torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))))
        elif case == "refused Checkpoint.read":
            path = os.path.join(DIR, case)
            mr.train.Checkpoint(model=trained()).write(path)
            error = refused(lambda: mr.train.Checkpoint(model=mlp(width=9)).read(path))
        elif case == "refused BackupAndRestore":
            directory, path = backup(case)
            error = refused(lambda: mlp(width=9).fit(data(), epochs=2, verbose=0, callbacks=[
                mr.callbacks.BackupAndRestore(directory, delete_checkpoint=False)]))
        os.truncate(path, 0)  # rewritten in place (cp, a sync tool, another job): every page of it is gone
        if case.startswith("refused"):
            assert touch_traceback(error) > 0  # the frames hold the file's tensors
        touch_everything_kept()
        for model in [k for k in kept if isinstance(k, mr.Model)]:
            model.fit(data(), epochs=1, verbose=0)  # a step reads the weights and the optimizer state

    DIR = sys.argv[1]
    for case in sys.argv[2:]:
        print("start", case, flush=True)
        run(case)
        print("ok", case, flush=True)
''')

CASES = ["load_checkpoint", "load_state_dict", "Model.load", "Model.load_weights", "Checkpoint.restore",
         "Checkpoint.read", "BackupAndRestore", "refused Model.load", "refused Checkpoint.read",
         "refused BackupAndRestore"]


def test_no_loaded_tensor_is_a_view_of_the_file_once_the_load_returns_or_raises(tmp_path):
    """Issue 25. A child that dies in a case (SIGBUS: a mapped tensor) is restarted with the cases after it,
    so the failure lists every way of loading that still maps the file."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    todo, failed = list(CASES), []
    while todo:
        result = subprocess.run([sys.executable, str(script), str(tmp_path), *todo], capture_output=True,
                                text=True, timeout=300)
        done = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
        todo = todo[len(done):]
        if result.returncode == 0:
            assert not todo, result.stdout
            break
        crashed = todo.pop(0)
        why = ("SIGBUS: a tensor was still a view of the file" if result.returncode == -signal.SIGBUS
               else f"exit {result.returncode}: {result.stderr[-2000:]}")
        failed.append(f"{crashed}: {why}")
    assert failed == [], "\n".join(failed)

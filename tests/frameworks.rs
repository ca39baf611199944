//! Real frameworks under the real library (CPU: no GPU on these machines). PyTorch comes
//! from PyPI (`pip install torch`, done by scripts/setup.sh); the growth check of a training loop
//! that keeps its losses is in `cli/tests/cli.rs` (it needs the `leaktrace` command).
mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn script() -> PathBuf {
    root().join("tests/fixtures/frameworks/torch_train.py")
}

/// Whether the interpreter has `module`; otherwise the test is skipped (under CI, where
/// scripts/setup.sh installs it, a failure).
fn have_module(module: &str, package: &str) -> bool {
    let python = python();
    let ok = Command::new(&python).args(["-c", &format!("import {module}")]).timed_output().map(|o| o.status.success()).unwrap_or(false);
    if !ok {
        skip::missing(&format!("{module} for {}", python.display()), &format!("python3 -m pip install {package}"));
    }
    ok
}

fn require_torch() -> bool {
    have_module("torch", "torch")
}

fn torch(mode: &str) -> Command {
    let mut c = Command::new(python());
    c.arg(script()).arg(mode).env("LEAKTRACE_SUMMARY", "0").env_remove("PYTHONMALLOC");
    c
}

fn stdout_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn pytorch_training_with_dataloader_workers_runs_unchanged_and_every_process_reports() {
    if !require_torch() {
        return;
    }
    let plain = run_plain(torch("train"));
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let run = run_traced(torch("train"), "torch-train");
    assert_eq!(run.code(), Some(0), "stderr:\n{}", run.stderr());
    assert_eq!(run.stdout(), stdout_of(&plain), "the losses must not change under leaktrace");
    assert!(run.stdout().starts_with("epoch 0 loss "), "{}", run.stdout());

    let reports = run.reports();
    let main: Vec<&Value> = reports.iter().filter(|r| r["fork"]["forked_from_pid"].is_null()).collect();
    assert_eq!(main.len(), 1, "one report of the training process");
    let main = main[0];
    // Two workers per epoch, forked, each ending with os._exit: each has its own report.
    let workers: Vec<&Value> = reports.iter().filter(|r| r["fork"]["forked_from_pid"] == main["pid"]).collect();
    assert_eq!(workers.len(), 4, "{} reports", reports.len());
    for r in reports.iter() {
        assert_eq!(r["reason"], "exit");
        let h = &r["summary"]["host"];
        assert_eq!(
            h["total_allocs"].as_u64().unwrap() - h["total_frees"].as_u64().unwrap(),
            h["live_blocks"].as_u64().unwrap(),
            "pid {} (forked from {}): {:#} {:#}",
            r["pid"],
            r["fork"]["forked_from_pid"],
            h,
            r["diagnostics"]
        );
        // The library's own blocks are never the program's: a worker's collector thread,
        // started in the fork handler, resized the thread-local-storage vector there.
        let ours: Vec<&Value> = r["leaks"].as_array().unwrap().iter().filter(|g| g["stack"].to_string().contains("leaktrace::")).collect();
        assert!(ours.is_empty(), "pid {}: {ours:#?}", r["pid"]);
    }
    // The planted native leak (100 x malloc(4096) through ctypes), with the stack that
    // led to it through the interpreter.
    let planted: Vec<&Value> = main["leaks"].as_array().unwrap().iter().filter(|g| g["blocks"] == 100 && g["bytes"] == 409_600).collect();
    assert_eq!(planted.len(), 1, "the ctypes malloc loop, one group");
    let frames: Vec<&str> = planted[0]["stack"].as_array().unwrap().iter().filter_map(|f| f["function"].as_str()).collect();
    assert!(frames.iter().any(|f| f.contains("ffi_call")), "{frames:?}");
    assert!(frames.iter().any(|f| f.contains("_PyEval_EvalFrameDefault")), "{frames:?}");
    // A report stays usable on a process that imported torch: its half a million
    // groups of static data are added up, not listed.
    assert!(main["leaks"].as_array().unwrap().len() <= 2000);
    assert!(main["summary"]["omitted"]["groups"].as_u64().unwrap() > 0);
}

#[test]
fn the_cuda_runtime_the_torch_wheel_ships_is_interposed_without_a_gpu() {
    if !require_torch() {
        return;
    }
    let plain = run_plain(torch("cudart"));
    let run = run_traced(torch("cudart"), "torch-cudart");
    assert_eq!(run.code(), Some(0), "stderr:\n{}", run.stderr());
    let out = run.stdout();
    assert_eq!(out, stdout_of(&plain));
    // No driver here: the runtime answers 35 (cudaErrorInsufficientDriver), unchanged.
    assert!(out.contains("runtime: libcudart.so.1"), "{out}");
    assert!(out.contains("cudaMalloc: 35\ncudaMallocHost: 35\n"), "{out}");
    let r = run.reports().into_iter().find(|r| r["fork"]["forked_from_pid"].is_null()).unwrap();
    for kind in ["device", "pinned", "managed"] {
        assert_eq!(r["summary"][kind]["total_allocs"], 0, "{kind}: nothing recorded for failed calls");
    }
}

/// TensorFlow (`tensorflow-cpu` from PyPI, installed by scripts/setup.sh): a small Keras fit.
#[test]
fn tensorflow_keras_fit_runs_unchanged_and_gets_a_report() {
    if !have_module("tensorflow", "tensorflow-cpu") {
        return;
    }
    let fit = || {
        let mut c = Command::new(python());
        c.arg(root().join("tests/fixtures/frameworks/keras_fit.py")).env("LEAKTRACE_SUMMARY", "0");
        c
    };
    let plain = run_plain(fit());
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let run = run_traced(fit(), "keras");
    assert_eq!(run.code(), Some(0), "stderr:\n{}", run.stderr());
    assert_eq!(run.stdout(), stdout_of(&plain), "the loss must not change under leaktrace");
    assert!(run.stdout().starts_with("final loss "));
    let main = run.reports().into_iter().find(|r| r["exe"].as_str().unwrap_or("").contains("python")).expect("the interpreter's report");
    assert_eq!(main["reason"], "exit");
    let h = &main["summary"]["host"];
    assert!(h["total_allocs"].as_u64().unwrap() > 100_000, "TensorFlow's allocations are seen");
    assert_eq!(h["total_allocs"].as_u64().unwrap() - h["total_frees"].as_u64().unwrap(), h["live_blocks"].as_u64().unwrap());
}

/// BVLC Caffe (CPU): bullseye's package on bookworm, unpacked by
/// `scripts/install_caffe.sh` (idempotent; scripts/setup.sh runs it, and it prints the
/// library path as its last line). `caffe train` on a LeNet-style net fed by DummyData,
/// and `caffe time`.
#[test]
fn caffe_train_and_time_run_unchanged_and_get_reports() {
    let prefix = std::env::var("LEAKTRACE_CAFFE_PREFIX").unwrap_or_else(|_| "/var/cache/leaktrace/caffe".into());
    // Installed by scripts/setup.sh; here only its library path is asked for (the
    // script does nothing else when Caffe is in place).
    if !PathBuf::from(&prefix).join("usr/bin/caffe").is_file() {
        skip::missing(&format!("Caffe in {prefix}"), "scripts/install_caffe.sh, as root");
        return;
    }
    let install = Command::new("bash").arg(root().join("scripts/install_caffe.sh")).arg(&prefix).timed_output().unwrap();
    assert!(install.status.success(), "Caffe in {prefix} is incomplete:\n{}", String::from_utf8_lossy(&install.stderr));
    let libpath = stdout_of(&install).lines().last().unwrap_or_default().to_owned();
    let dir = root().join("tests/fixtures/frameworks/caffe");
    let caffe = |args: &[&str]| {
        let mut c = Command::new(PathBuf::from(&prefix).join("usr/bin/caffe"));
        c.args(args).current_dir(&dir).env("LD_LIBRARY_PATH", &libpath).env("LEAKTRACE_SUMMARY", "0");
        c
    };
    // glog lines carry times, thread ids and speeds: compare what the net computed.
    let losses = |o: &std::process::Output| -> Vec<String> {
        String::from_utf8_lossy(&o.stderr).lines().filter_map(|l| l.rsplit_once("loss = ").map(|x| x.1.to_owned())).collect()
    };
    let train = ["train", "-solver", "solver.prototxt"];
    let plain = run_plain(caffe(&train));
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let run = run_traced(caffe(&train), "caffe-train");
    assert_eq!(run.code(), Some(0), "stderr:\n{}", run.stderr());
    assert!(losses(&plain).len() >= 20);
    assert_eq!(losses(&run.output), losses(&plain), "the losses must not change under leaktrace");
    let r = run.report();
    assert_eq!(r["reason"], "exit");
    assert!(r["summary"]["host"]["total_allocs"].as_u64().unwrap() > 1000);
    // caffe time prints its timing summary; under leaktrace it must still get there.
    let run = run_traced(caffe(&["time", "-model", "lenet_dummy.prototxt", "-iterations", "10"]), "caffe-time");
    assert_eq!(run.code(), Some(0), "stderr:\n{}", run.stderr());
    assert!(run.stderr().contains("*** Benchmark ends ***"), "{}", run.stderr());
    assert_eq!(run.report()["reason"], "exit");
}

/// `torch_holders.py MODE`: every "held by" line of every report of the run (the
/// DataLoader's worker has its own).
fn torch_holders(mode: &str) -> Vec<String> {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/fixtures/frameworks/torch_holders.py")).arg(mode);
    let run = run_traced(cmd, &format!("torch-holders-{mode}"));
    assert!(run.output.status.success(), "{}", run.stderr());
    let mut out = Vec::new();
    for r in run.reports() {
        // What each process followed, for a failure's message.
        let series: Vec<String> = r["timeline"]["series"]
            .as_array()
            .unwrap()
            .iter()
            .take(3)
            .map(|s| format!("{} {}", s["bytes"], s["held_by"].as_array().map_or(0, Vec::len)))
            .collect();
        out.push(format!("pid {} forked from {}: {}", r["pid"], r["fork"]["forked_from_pid"], series.join("; ")));
        for v in r["timeline"]["series"].as_array().unwrap().iter().chain(r["leaks"].as_array().unwrap()) {
            let links: Vec<leaktrace_common::report_schema::HeldLink> = serde_json::from_value(v["held_by"].clone()).unwrap_or_default();
            out.extend(leaktrace_common::held::held_by_text(&links));
        }
    }
    out
}

/// A forward hook registered every step keeps each step's output: the tensor's memory
/// is held by the Tensor, the hook's closure and the layer's hook registry.
#[test]
fn a_forward_hook_registered_every_step_is_named_as_the_holder() {
    if !require_torch() {
        return;
    }
    let all = torch_holders("hook");
    assert!(
        all.iter().any(|t| t.contains("Tensor (Python object") && t.contains("function (Python object") && t.contains("collections.OrderedDict")),
        "{}",
        all.join("\n")
    );
}

/// A Dataset that keeps what it loads, in a DataLoader worker: the worker's report
/// names the dataset's attribute.
#[test]
fn a_dataloader_workers_own_holder_is_its_dataset_attribute() {
    if !require_torch() {
        return;
    }
    let all = torch_holders("worker");
    assert!(all.iter().any(|t| t.contains("Tensor (Python object") && t.contains("an attribute of a Data object")), "{}", all.join("\n"));
}

//! Teardown reports what fails: a free that fails while a session releases
//! its graphs and buffers (injected on the host backend) is counted in the
//! session's stats, sent to its log at error level, and kept as the
//! process's last teardown error, for a reset, for a destroy and for a
//! failed capture; the session goes on working where it can.

use graphed::backend::host::inject_free_failures;
use graphed::ffi::*;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;
use std::sync::Mutex;

mod common;
use common::{layer_desc, ok, stats};

/// The log's error-level messages.
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn log(_: *mut c_void, level: u32, text: *const c_char) {
    if level == graphed_log_level::Error as u32 {
        // SAFETY: graphed passes a NUL-terminated message, valid during the call.
        let t = unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned();
        LOGGED.lock().unwrap().push(t);
    }
}

unsafe extern "C" fn nothing(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

unsafe extern "C" fn fail_in_capture(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: ctx is valid during the call.
    (unsafe { (*ctx).phase } == graphed_phase::Capture as u32) as i32
}

/// A host session of one callable with one parameter, not yet captured.
fn session(name: &str, backward: graphed_pass_fn) -> (*mut graphed_session, Vec<f32>) {
    let mut param = vec![0.5f32; 16];
    let tensor = graphed_tensor_desc {
        bytes: 64,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let pdesc = [graphed_param_desc {
        data: param.as_mut_ptr().cast(),
        bytes: 64,
        ..graphed_param_desc_default()
    }];
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.log = Some(log);
    let cname = std::ffi::CString::new(name).unwrap();
    cfg.name = cname.as_ptr();
    let mut s = null_mut();
    let d = layer_desc(&tensor, &tensor, &pdesc, Some(nothing), backward);
    let mut idx = 0;
    // SAFETY: valid pointers to live locals, counts matching the arrays.
    unsafe {
        ok(graphed_session_create(&cfg, &mut s));
        ok(graphed_session_add_callable(s, &d, &mut idx));
    }
    (s, param)
}

fn process_errors() -> (u64, String) {
    let (mut count, mut len) = (0u64, 0usize);
    let mut buf = vec![0 as c_char; 512];
    // SAFETY: writable outputs; the buffer has 512 bytes.
    ok(unsafe { graphed_teardown_errors(&mut count, buf.as_mut_ptr(), buf.len(), &mut len) });
    // SAFETY: graphed NUL-terminated the text.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    (count, text)
}

fn logged(session: &str) -> Vec<String> {
    let prefix = format!("session '{session}': ");
    LOGGED
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.starts_with(&prefix))
        .cloned()
        .collect()
}

#[test]
fn a_failing_free_during_reset_is_counted_logged_and_kept() {
    let (s, _param) = session("reset", Some(nothing));
    ok(graphed_session_capture(s));
    let (before, _) = process_errors();
    assert_eq!(stats(s).teardown_errors, 0);
    inject_free_failures(1);
    ok(graphed_session_reset(s));
    inject_free_failures(0);
    assert_eq!(stats(s).teardown_errors, 1, "the reset still succeeded");
    let log = logged("reset");
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].contains("failed during teardown"), "{}", log[0]);
    assert!(
        log[0].contains("injected failure of a host free"),
        "{}",
        log[0]
    );
    let (after, text) = process_errors();
    assert!(after > before);
    assert!(text.contains("failed during teardown"), "{text}");
    ok(graphed_session_destroy(s));
}

#[test]
fn a_failing_free_during_destroy_is_logged_and_kept() {
    let (s, _param) = session("destroy", Some(nothing));
    ok(graphed_session_capture(s));
    let (before, _) = process_errors();
    inject_free_failures(2);
    ok(graphed_session_destroy(s));
    inject_free_failures(0);
    assert_eq!(logged("destroy").len(), 2);
    assert!(process_errors().0 >= before + 2);
}

#[test]
fn a_failed_capture_reports_its_teardown_too() {
    let (s, _param) = session("failed", Some(fail_in_capture));
    inject_free_failures(1);
    let st = graphed_session_capture(s);
    inject_free_failures(0);
    assert_eq!(st, graphed_status::CallbackFailed);
    assert_eq!(stats(s).teardown_errors, 1);
    assert_eq!(logged("failed").len(), 1);
    ok(graphed_session_destroy(s));
}

#[test]
fn the_query_checks_its_arguments() {
    let mut count = 0u64;
    let mut len = 0usize;
    // SAFETY: NULL outputs are refused before anything is written.
    unsafe {
        assert_eq!(
            graphed_teardown_errors(null_mut(), null_mut(), 0, &mut len),
            graphed_status::NullPointer
        );
        assert_eq!(
            graphed_teardown_errors(&mut count, null_mut(), 0, null_mut()),
            graphed_status::NullPointer
        );
        // A NULL buffer asks for the length only.
        ok(graphed_teardown_errors(&mut count, null_mut(), 0, &mut len));
    }
}

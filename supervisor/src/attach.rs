//! A warm pod's shape: the supervisor starts as the pod's main process (`--listen`), loads its runtime
//! and proves an instance works before the pod turns Ready, then waits on the abstract unix socket
//! `@sluice-supervisor` for exactly one attach. The gateway execs `sluice-supervisor attach` into the
//! claimed pod: that relay hands the exec's stdin, stdout and stderr over the socket (SCM_RIGHTS),
//! so the protocol runs straight over the exec's pipes and the relay copies no byte. When the gateway
//! closes stdin, the supervisor sends the relay one status byte and exits, which ends the pod.
//! `attach --probe` is the startup probe: it asks whether the supervisor is up, waiting (`ready`) or
//! already serving its gateway (`attached`): a kubelet that restarts runs every pod's startup probe
//! again, and a held pod must pass it or be killed. A second attach is refused.

// Passing descriptors over a unix socket needs sendmsg/recvmsg with control messages, which std
// does not offer on stable Rust; each unsafe block below is one such call on buffers it owns.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use crate::protocol::Channel;
use crate::runtime::Runtime;
use crate::supervisor::Supervisor;

const ADDRESS: &str = "sluice-supervisor";
/// Below the pod's probe timeoutSeconds (5): while the supervisor starts, a probe keeps trying.
const PROBE_WAIT: Duration = Duration::from_secs(4);

/// The abstract socket's name; `SLUICE_ATTACH` overrides it (tests running several pods on one
/// host). Read once, before any hook exists; hooks have no environment at all.
fn address() -> std::io::Result<SocketAddr> {
    let name = std::env::var("SLUICE_ATTACH")
        .ok()
        .filter(|n| !n.is_empty());
    let name = name
        .as_deref()
        .map(|n| n.trim_start_matches('@'))
        .unwrap_or(ADDRESS);
    SocketAddr::from_abstract_name(name.as_bytes())
}

fn log(line: &str) {
    let _ = writeln!(std::io::stderr(), "sluice supervisor: {line}");
}

/// The pod's main process after its runtime passed the self-check. Returns the exit status.
pub(crate) fn listen(runtime: Runtime) -> u8 {
    let listener = match address().and_then(|a| UnixListener::bind_addr(&a)) {
        Ok(l) => l,
        Err(e) => {
            log(&format!("cannot listen on @{ADDRESS}: {e}"));
            return 1;
        }
    };
    log("ready: cells work here, waiting for the gateway's attach");
    let (conn, fds, relay) = loop {
        let Ok((conn, _)) = listener.accept() else {
            continue;
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let Ok((request, fds)) = receive(&conn) else {
            continue;
        };
        match request.split_once(' ') {
            None if request == "probe" => {
                let _ = (&conn).write_all(b"ready");
            }
            Some(("attach", pid)) if fds.len() == 3 && pid.bytes().all(|b| b.is_ascii_digit()) => {
                break (conn, fds, pid.to_string());
            }
            _ => {
                let _ = (&conn).write_all(b"unknown request");
            }
        }
    };
    // One attach per pod: from now on the socket only tells probes the pod is alive and refuses
    // every other attach.
    std::thread::spawn(move || answer_while_attached(&listener));
    let _ = conn.set_read_timeout(None);
    let mut fds = fds.into_iter();
    let (Some(proto_in), Some(_exec_stdout), Some(proto_out)) =
        (fds.next(), fds.next(), fds.next())
    else {
        return 1;
    };
    log(&format!("attached (relay pid {relay})"));
    Supervisor::new(
        runtime,
        Channel::new(File::from(proto_in), File::from(proto_out)),
    )
    .serve();
    let _ = (&conn).write_all(&[0]);
    0
}

/// The socket of a supervisor that serves its gateway: probes get `attached`, a second attach
/// `already attached` (its descriptors closed unused). Runs until the process exits.
fn answer_while_attached(listener: &UnixListener) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let answer: &[u8] = match receive(&conn) {
            Ok((request, _fds)) if request == "probe" => b"attached",
            Ok((request, _fds)) if request.starts_with("attach") => b"already attached",
            _ => b"unknown request",
        };
        let _ = (&conn).write_all(answer);
    }
}

/// The relay the gateway execs into a claimed pod, or (`probe`) the pod's readiness probe.
pub(crate) fn relay(probe: bool) -> u8 {
    let fail = |message: String| {
        // On attach, stderr is the gateway's protocol stream: one plain line, reported verbatim.
        let _ = writeln!(std::io::stderr(), "sluice attach: {message}");
        1
    };
    let address = match address() {
        Ok(a) => a,
        Err(e) => return fail(format!("bad socket name: {e}")),
    };
    let began = Instant::now();
    let conn = loop {
        match UnixStream::connect_addr(&address) {
            Ok(conn) => break conn,
            Err(e) if probe && began.elapsed() < PROBE_WAIT => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return fail(format!("no supervisor is waiting in this sandbox ({e})")),
        }
    };
    if probe {
        let _ = conn.set_read_timeout(Some(PROBE_WAIT));
        if send(&conn, "probe", &[]).is_err() {
            return fail("the supervisor went away".into());
        }
        let mut answer = Vec::new();
        let _ = (&conn).take(64).read_to_end(&mut answer);
        return if answer == b"ready" || answer == b"attached" {
            0
        } else {
            fail(format!(
                "the supervisor answered {:?}",
                String::from_utf8_lossy(&answer)
            ))
        };
    }
    if send(&conn, &format!("attach {}", std::process::id()), &[0, 1, 2]).is_err() {
        return fail("the supervisor went away".into());
    }
    // One byte is the status; more is a refusal in words.
    let mut status = Vec::new();
    match (&conn).take(64).read_to_end(&mut status) {
        Ok(_) if status.len() == 1 => status[0],
        Ok(_) if status.len() > 1 => fail(format!(
            "the supervisor refused the attach: {}",
            String::from_utf8_lossy(&status)
        )),
        _ => fail("the supervisor ended without reporting a status".into()),
    }
}

fn send(conn: &UnixStream, text: &str, fds: &[RawFd]) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: text.as_ptr() as *mut libc::c_void,
        iov_len: text.len(),
    };
    let space = unsafe { libc::CMSG_SPACE(size_of_val(fds) as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: `control` is CMSG_SPACE bytes for `fds.len()` descriptors, as the header says.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: `msg` points at `iov` and `control`, both alive for the call.
    let sent = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// One request (text) and the descriptors that came with it (at most three).
fn receive(conn: &UnixStream) -> std::io::Result<(String, Vec<OwnedFd>)> {
    let mut data = [0u8; 64];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let space = unsafe { libc::CMSG_SPACE((3 * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` points at `data` and `control`, both alive for the call.
    let read = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if read < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to `msg_controllen`; the CMSG macros stay within it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count =
                    ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((
        String::from_utf8_lossy(&data[..read as usize]).into_owned(),
        fds,
    ))
}

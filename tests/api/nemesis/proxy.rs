//! Owner-aware TCP proxies: one in front of every Redis node and of Postgres, and every
//! client (the seckill processes, the replicas, the sentinels) reaches a server only
//! through its proxy. At accept the proxy finds which of our processes holds the
//! client's socket (its port in /proc/net/tcp, that socket's inode, the process with
//! `socket:[inode]` among its descriptors) and tags the connection, so a fault can cut
//! one process's link to one server while every other link stays up: a replica's
//! replication link, one worker's Postgres, the sentinels' view of the primary.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// Who holds a client socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    Api(u8),
    Worker(u8),
    /// A Redis node: its replication link.
    Node(u8),
    Sentinel(u8),
    /// None of our processes: the harness itself, or a short-lived tool.
    Harness,
}

/// The server behind a proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Node(u8),
    Postgres,
}

struct Conn {
    owner: Owner,
    target: Target,
    frozen: Arc<AtomicBool>,
    task: AbortHandle,
}

/// The links' state, shared by every proxy: which process is which owner, which
/// (owner, target) pairs are cut or frozen, and every connection passing.
#[derive(Default)]
pub struct Links {
    pids: Mutex<HashMap<u32, Owner>>,
    cut: Mutex<HashSet<(Owner, Target)>>,
    frozen: Mutex<HashSet<(Owner, Target)>>,
    conns: Mutex<Vec<Conn>>,
}

impl Links {
    /// Records that `pid` is `owner` (a process started or started again).
    pub fn register(&self, pid: u32, owner: Owner) {
        self.pids.lock().unwrap().insert(pid, owner);
    }

    pub fn forget(&self, pid: u32) {
        self.pids.lock().unwrap().remove(&pid);
    }

    /// Drops the owner's connections to the target and refuses its new ones.
    pub fn cut(&self, owner: Owner, target: Target) {
        self.cut.lock().unwrap().insert((owner, target));
        for c in self.conns.lock().unwrap().iter() {
            if (c.owner, c.target) == (owner, target) {
                c.task.abort();
            }
        }
    }

    /// Holds every byte of the owner's connections to the target (new ones too) until
    /// [`Links::thaw`]: nothing is lost, as in a partition TCP outlives, and the client
    /// notices only by its own timeouts.
    pub fn freeze(&self, owner: Owner, target: Target) {
        self.frozen.lock().unwrap().insert((owner, target));
        self.set_frozen(owner, target, true);
    }

    pub fn heal(&self, owner: Owner, target: Target) {
        self.cut.lock().unwrap().remove(&(owner, target));
    }

    pub fn thaw(&self, owner: Owner, target: Target) {
        self.frozen.lock().unwrap().remove(&(owner, target));
        self.set_frozen(owner, target, false);
    }

    /// Every link healed and thawed.
    pub fn heal_all(&self) {
        self.cut.lock().unwrap().clear();
        let frozen: Vec<_> = self.frozen.lock().unwrap().drain().collect();
        for (owner, target) in frozen {
            self.set_frozen(owner, target, false);
        }
    }

    fn set_frozen(&self, owner: Owner, target: Target, on: bool) {
        for c in self.conns.lock().unwrap().iter() {
            if (c.owner, c.target) == (owner, target) {
                c.frozen.store(on, Ordering::SeqCst);
            }
        }
    }

    /// The owners of the connections now open to `target` (for tests and logs).
    pub fn owners_to(&self, target: Target) -> Vec<Owner> {
        let conns = self.conns.lock().unwrap();
        conns
            .iter()
            .filter(|c| c.target == target && !c.task.is_finished())
            .map(|c| c.owner)
            .collect()
    }

    fn is_cut(&self, owner: Owner, target: Target) -> bool {
        self.cut.lock().unwrap().contains(&(owner, target))
    }

    fn is_frozen(&self, owner: Owner, target: Target) -> bool {
        self.frozen.lock().unwrap().contains(&(owner, target))
    }

    fn track(&self, conn: Conn) {
        let mut conns = self.conns.lock().unwrap();
        conns.retain(|c| !c.task.is_finished());
        conns.push(conn);
    }

    /// Which registered process holds the client socket of a connection from
    /// 127.0.0.1:`client_port` to our port `proxy_port`.
    fn owner_of(&self, client_port: u16, proxy_port: u16) -> Owner {
        let Some(inode) = socket_inode(client_port, proxy_port) else {
            return Owner::Harness;
        };
        let link = format!("socket:[{inode}]");
        let pids: Vec<(u32, Owner)> = self
            .pids
            .lock()
            .unwrap()
            .iter()
            .map(|(p, o)| (*p, *o))
            .collect();
        pids.into_iter()
            .find(|(pid, _)| holds(*pid, &link))
            .map_or(Owner::Harness, |(_, owner)| owner)
    }
}

/// The inode of the socket from `local_port` to `remote_port`, from /proc/net/tcp
/// (`sl local_address rem_address st ... uid timeout inode`, ports in hex).
fn socket_inode(local_port: u16, remote_port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let port = |field: &str| u16::from_str_radix(field.rsplit(':').next()?, 16).ok();
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() > 9 && port(f[1]) == Some(local_port) && port(f[2]) == Some(remote_port))
            .then(|| f[9].parse().ok())
            .flatten()
    })
}

/// Whether process `pid` has the descriptor `link` (`socket:[inode]`).
fn holds(pid: u32, link: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == std::ffi::OsStr::new(link))
    })
}

/// A proxy on `port` in front of `server`; stops (and drops its connections) on drop.
pub struct OwnedProxy {
    pub port: u16,
    accept: AbortHandle,
    links: Arc<Links>,
    target: Target,
}

impl OwnedProxy {
    pub async fn start(links: Arc<Links>, port: u16, target: Target, server: SocketAddr) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("proxy port {port}: {e}"));
        let shared = links.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let links = shared.clone();
                let task = tokio::spawn(serve(links.clone(), inbound, peer, port, target, server));
                drop(task);
            }
        })
        .abort_handle();
        Self {
            port,
            accept,
            links,
            target,
        }
    }
}

impl Drop for OwnedProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.links.conns.lock().unwrap().iter() {
            if c.target == self.target {
                c.task.abort();
            }
        }
    }
}

/// One connection: whose it is, then (unless its link is cut) both directions copied
/// until either side closes.
async fn serve(
    links: Arc<Links>,
    inbound: TcpStream,
    peer: SocketAddr,
    port: u16,
    target: Target,
    server: SocketAddr,
) {
    let finder = links.clone();
    let owner = tokio::task::spawn_blocking(move || finder.owner_of(peer.port(), port))
        .await
        .unwrap_or(Owner::Harness);
    if links.is_cut(owner, target) {
        return;
    }
    let frozen = Arc::new(AtomicBool::new(links.is_frozen(owner, target)));
    let flag = frozen.clone();
    let pipe = tokio::spawn(async move {
        let Ok(Ok(outbound)) =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(server)).await
        else {
            return;
        };
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        let (from_client, to_client) = inbound.into_split();
        let (from_server, to_server) = outbound.into_split();
        tokio::select! {
            _ = pass(from_client, to_server, flag.clone()) => {}
            _ = pass(from_server, to_client, flag) => {}
        }
    });
    let task = pipe.abort_handle();
    links.track(Conn {
        owner,
        target,
        frozen,
        task,
    });
    // A cut that came while the connection was being set up.
    if links.is_cut(owner, target) {
        pipe.abort();
    }
}

/// Copies one direction until either side closes, holding the bytes while frozen.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on a spare port.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_proxy_tags_a_connection_with_the_process_that_holds_it_and_cuts_only_its_link() {
        let links = Arc::new(Links::default());
        let port = super::super::topology::port();
        let proxy = OwnedProxy::start(links.clone(), port, Target::Postgres, echo().await).await;
        // A child process holding a connection through the proxy.
        let mut child = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("exec 3<>/dev/tcp/127.0.0.1/{port}; sleep 30"))
            .spawn()
            .unwrap();
        links.register(child.id(), Owner::Worker(1));
        let mut ours = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut owners = links.owners_to(Target::Postgres);
            owners.sort_by_key(|o| format!("{o:?}"));
            if owners == [Owner::Harness, Owner::Worker(1)] {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "owners {owners:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        links.cut(Owner::Worker(1), Target::Postgres);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(links.owners_to(Target::Postgres), [Owner::Harness]);
        ours.write_all(b"still up").await.unwrap();
        let mut buf = [0u8; 8];
        ours.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"still up");
        let _ = child.kill();
        let _ = child.wait();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_proxy_passes_thousands_of_round_trips_a_second() {
        let links = Arc::new(Links::default());
        let port = super::super::topology::port();
        let proxy = OwnedProxy::start(links, port, Target::Node(0), echo().await).await;
        let began = std::time::Instant::now();
        let clients: Vec<_> = (0..4)
            .map(|_| {
                tokio::spawn(async move {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
                    s.set_nodelay(true).unwrap();
                    let mut buf = [0u8; 16];
                    for _ in 0..2_000 {
                        s.write_all(b"*1\r\n$4\r\nPING\r\n..").await.unwrap();
                        s.read_exact(&mut buf).await.unwrap();
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.unwrap();
        }
        let per_sec = 8_000.0 / began.elapsed().as_secs_f64();
        println!("through the proxy: {per_sec:.0} round trips/s");
        assert!(per_sec > 3_000.0, "{per_sec:.0} round trips/s");
        drop(proxy);
    }
}

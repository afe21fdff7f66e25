package dedup

import (
	"container/list"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// diskTier caches response bodies too big to keep whole in memory (over
// max_body_bytes), each in a file of its own in this process's directory
// under disk.dir, bounded by the total size of the files (disk.max_bytes),
// evicting the least recently used; an entry's file goes when it expires.
// The index (key → file and the
// response's status and headers) is in memory: the tier starts empty and
// its files go with the process (Close, or the next start after a crash).
//
// Only the engine uses it, and only for its own flights: a shared Store
// (Redis, PostgreSQL) never sees these entries, so instances elsewhere in
// the fleet fetch their own copy of a big body.
type diskTier struct {
	dir *runDir
	max int64

	mu        sync.Mutex // protects everything below
	byKey     map[string]*list.Element
	lru       *list.List // of *diskObject; front = most recently used
	bytes     int64
	evictions uint64
}

// diskObject is one cached body and what is needed to answer with it.
type diskObject struct {
	key    string
	meta   *Entry      // Body nil; file set: the path and size
	expiry *time.Timer // removes the entry at meta.ExpiresAt; stopped when it goes otherwise
}

func newDiskTier(dir *runDir, maxBytes int64) *diskTier {
	return &diskTier{dir: dir, max: maxBytes, byKey: map[string]*list.Element{}, lru: list.New()}
}

// errTooBigForDisk: the body alone exceeds disk.max_bytes.
var errTooBigForDisk = errors.New("body larger than dedup.disk.max_bytes")

// errNoDiskRoom: the room is taken by other bodies being put at the same
// time; this one is not cached.
var errNoDiskRoom = errors.New("dedup.disk.max_bytes taken by bodies being stored")

// put caches the body in the file at src (a complete spool file) under key.
// The tier gets a hard link to it when it can (no copy: the spool removes
// its own name when its readers are done), else a copy. meta's Body is
// ignored; its ExpiresAt must be set.
func (d *diskTier) put(key string, meta *Entry, src string, size int64) error {
	return d.store(key, meta, size, func() (string, error) { return d.link(src) })
}

// putBytes is put for a body in memory: it is written to a file of the
// tier's own.
func (d *diskTier) putBytes(key string, meta *Entry, body []byte) error {
	return d.store(key, meta, int64(len(body)), func() (string, error) { return d.write(body) })
}

// store caches under key the body of size bytes that makeFile puts in a
// file of the tier's own, returning its path.
func (d *diskTier) store(key string, meta *Entry, size int64, makeFile func() (string, error)) error {
	if size > d.max {
		return errTooBigForDisk
	}
	// The room first, counted in bytes before the file is there: a file
	// written first (a copy when disk.dir is on another filesystem than
	// spool_dir, a body from memory) had the directory hold max_bytes and
	// the body, and on a volume of max_bytes failed for want of the room
	// its evictions would have freed.
	d.mu.Lock()
	var victims []string
	if old, ok := d.byKey[key]; ok {
		// Replaced: its room goes to the new file before anybody else's.
		victims = append(victims, old.Value.(*diskObject).meta.file.path)
		d.removeLocked(old)
	}
	for d.bytes+size > d.max && d.lru.Len() > 0 {
		back := d.lru.Back()
		victims = append(victims, back.Value.(*diskObject).meta.file.path)
		d.removeLocked(back)
		d.evictions++
	}
	room := d.bytes+size <= d.max
	if room {
		d.bytes += size
	}
	d.mu.Unlock()
	removeFiles(victims)
	if !room {
		return errNoDiskRoom
	}
	path, err := makeFile()
	if err != nil {
		d.mu.Lock()
		d.bytes -= size
		d.mu.Unlock()
		return fmt.Errorf("disk tier: %w", err)
	}
	m := *meta
	m.Body, m.packed = nil, packed{}
	m.file = &diskFile{path: path, size: size}
	obj := &diskObject{key: key, meta: &m}
	victims = victims[:0]
	d.mu.Lock()
	if old, ok := d.byKey[key]; ok {
		// Put by another download of key meanwhile.
		victims = append(victims, old.Value.(*diskObject).meta.file.path)
		d.removeLocked(old)
	}
	d.byKey[key] = d.lru.PushFront(obj) // its size is counted already
	// An expired entry is never served, only found by a request for its
	// key or evicted for room: without this its file stayed for as long
	// as neither came.
	obj.expiry = time.AfterFunc(time.Until(m.ExpiresAt), func() { d.expire(obj) })
	d.mu.Unlock()
	removeFiles(victims)
	return nil
}

// write puts body in a file of the tier's own.
func (d *diskTier) write(body []byte) (string, error) {
	f, err := d.dir.create("obj-*")
	if err != nil {
		return "", err
	}
	_, err = f.Write(body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

// link gives src a name of the tier's own.
func (d *diskTier) link(src string) (string, error) {
	f, err := d.dir.create("obj-*")
	if err != nil {
		return "", err
	}
	path := f.Name()
	f.Close()
	// os.Link will not replace: free the name we reserved, then take it.
	os.Remove(path)
	if err := os.Link(src, path); err == nil {
		return path, nil
	}
	// Another filesystem (spool_dir and disk.dir on different mounts):
	// copy.
	if err := copyFile(path, src); err != nil {
		os.Remove(path)
		return "", err
	}
	return path, nil
}

func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// get returns the entry cached under key (its file set, Body nil), or nil.
// The file may be evicted before the caller opens it: open then fails and
// the caller fetches instead.
func (d *diskTier) get(key string) *Entry {
	d.mu.Lock()
	el, ok := d.byKey[key]
	if !ok {
		d.mu.Unlock()
		return nil
	}
	obj := el.Value.(*diskObject)
	if !time.Now().Before(obj.meta.ExpiresAt) {
		d.removeLocked(el)
		d.mu.Unlock()
		removeFiles([]string{obj.meta.file.path})
		return nil
	}
	d.lru.MoveToFront(el)
	d.mu.Unlock()
	return obj.meta
}

func (d *diskTier) delete(key string) {
	d.mu.Lock()
	el, ok := d.byKey[key]
	if ok {
		d.removeLocked(el)
	}
	d.mu.Unlock()
	if ok {
		removeFiles([]string{el.Value.(*diskObject).meta.file.path})
	}
}

// forget drops key's entry if it is still the one whose file is path: a
// file that cannot be opened any more (its directory was removed under the
// process) or that was cut short. Kept, the entry would send every request
// for key past the flight, upstream on its own, until it expired.
func (d *diskTier) forget(key, path string) {
	d.mu.Lock()
	el, ok := d.byKey[key]
	ok = ok && el.Value.(*diskObject).meta.file.path == path
	if ok {
		d.removeLocked(el)
	}
	d.mu.Unlock()
	if ok {
		removeFiles([]string{path})
	}
}

// expire removes obj when it is still key's entry: its timer may fire
// while it is replaced or evicted.
func (d *diskTier) expire(obj *diskObject) {
	d.mu.Lock()
	el, ok := d.byKey[obj.key]
	ok = ok && el.Value.(*diskObject) == obj
	if ok {
		d.removeLocked(el)
	}
	d.mu.Unlock()
	if ok {
		removeFiles([]string{obj.meta.file.path})
	}
}

// invalidated applies an invalidation made elsewhere in the fleet.
func (d *diskTier) invalidated(inv Invalidation) {
	if inv.Key != "" {
		d.delete(inv.Key)
	}
	if inv.URLKey != "" {
		d.deleteURL(inv.URLKey)
	}
}

// deleteURL removes every entry of urlKey: an admin action, so a walk.
func (d *diskTier) deleteURL(urlKey string) int {
	var victims []string
	d.mu.Lock()
	for el := d.lru.Front(); el != nil; {
		next := el.Next()
		if obj := el.Value.(*diskObject); obj.meta.URLKey == urlKey {
			victims = append(victims, obj.meta.file.path)
			d.removeLocked(el)
		}
		el = next
	}
	d.mu.Unlock()
	removeFiles(victims)
	return len(victims)
}

func (d *diskTier) removeLocked(el *list.Element) {
	obj := el.Value.(*diskObject)
	d.lru.Remove(el)
	delete(d.byKey, obj.key)
	d.bytes -= obj.meta.file.size
	obj.expiry.Stop()
}

// removeFiles unlinks evicted files. A client still reading one keeps its
// open file (its blocks are freed when it closes), so the directory may
// briefly hold more than max_bytes while evicted bodies are being sent.
func removeFiles(paths []string) {
	for _, p := range paths {
		os.Remove(p)
	}
}

func (d *diskTier) stats() StoreStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return StoreStats{Kind: "disk", Entries: d.lru.Len(), Bytes: d.bytes, MaxBytes: d.max, Evictions: d.evictions}
}

// close forgets every entry and removes the files.
func (d *diskTier) close() {
	d.mu.Lock()
	for el := d.lru.Front(); el != nil; el = el.Next() {
		el.Value.(*diskObject).expiry.Stop()
	}
	d.byKey, d.lru, d.bytes = map[string]*list.Element{}, list.New(), 0
	d.mu.Unlock()
	d.dir.remove()
}

// diskFile is where a disk-tier entry's body is.
type diskFile struct {
	path string
	size int64
}

// errFileCut is a disk-tier file that no longer holds its body: cut short
// (or grown) under the process.
var errFileCut = errors.New("disk tier: file size is not the body's")

// open opens the file for one response. A file of another size than the
// body fails it: served, it would send a client less than the
// Content-Length it was promised, and cut its connection.
func (f *diskFile) open() (*os.File, error) {
	fh, err := os.Open(f.path)
	if err != nil {
		return nil, err
	}
	info, err := fh.Stat()
	if err == nil && info.Size() != f.size {
		err = errFileCut
	}
	if err != nil {
		fh.Close()
		return nil, fmt.Errorf("open %s: %w", f.path, err)
	}
	return fh, nil
}

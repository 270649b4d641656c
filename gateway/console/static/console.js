// Ask before a form that cannot be undone is sent (resolving a receipt, revoking a lease).
document.addEventListener("submit", (event) => {
  const question = event.target.dataset.confirm;
  if (question && !window.confirm(question)) event.preventDefault();
});
